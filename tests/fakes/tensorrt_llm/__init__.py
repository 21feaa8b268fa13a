"""Fake tensorrt_llm: the LLM API surface our trtllm backend uses (see tests/fakes/README.md)."""
from tensorrt_llm import executor
from tensorrt_llm.llmapi import LLM, RequestOutput
from tensorrt_llm.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "executor"]
