"""The portable PyTorch engine: TensorRT-LLM executor semantics, no Ray."""
from app.engine.async_engine import AsyncLLMEngine
from app.engine.config import BatchingType, EngineConfig, KvCacheConfig, SchedulerPolicy
from app.engine.errors import EngineDeadError, InvalidRequestError
from app.engine.llm_engine import LLMEngine
from app.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from app.engine.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "BatchingType", "CompletionOutput", "EngineConfig", "EngineDeadError",
           "EngineStats", "InvalidRequestError", "KvCacheConfig", "LLMEngine", "RequestMetrics",
           "RequestOutput", "SamplingParams", "SchedulerPolicy"]
