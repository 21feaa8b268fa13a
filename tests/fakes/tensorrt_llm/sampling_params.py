"""Follows tensorrt_llm/sampling_params.py: SamplingParams and GuidedDecodingParams are slots,
keyword-only dataclasses; a guide is only recorded here (the portable engine underneath runs
unguided), since what TensorRT-LLM does with it cannot run on our machines."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Union

import torch
from pydantic import BaseModel


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Optional[Union[str, BaseModel, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None

    def _validate(self):
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, List[str]]] = None
    bad_token_ids: Optional[List[int]] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Optional[torch.Tensor] = None
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    length_penalty: Optional[float] = None
    min_p: Optional[float] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    guided_decoding: Optional[GuidedDecodingParams] = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.embedding_bias is not None:  # a [vocab_size] float32 tensor, added to the logits
            if isinstance(self.embedding_bias, torch.Tensor):
                self.embedding_bias = self.embedding_bias.detach().clone()
            else:
                self.embedding_bias = torch.tensor(self.embedding_bias, dtype=torch.float32)
        if self.best_of is None:
            self.best_of = self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
