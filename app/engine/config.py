"""Engine-side configuration: plain dataclasses, validated once, the single source of engine defaults.

The serving layer's pydantic schema (app/config.py) reads its defaults from here.
Names follow TensorRT-LLM's LLM API (max_batch_size, max_num_tokens, kv_cache_config, ...).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SchedulerPolicy(str, enum.Enum):
    """TensorRT-LLM's CapacitySchedulerPolicy names."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # admit only what can finish: never preempts
    MAX_UTILIZATION = "MAX_UTILIZATION"  # pack greedily, preempt by recompute when blocks run out


class BatchingType(str, enum.Enum):
    """Triton's gpt_model_type: in-flight batching or the static V1 mode kept for comparison."""

    INFLIGHT = "INFLIGHT"
    STATIC = "STATIC"


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    # Cache size: max_tokens wins when set; otherwise a fraction of the device memory left after
    # the weights, the CUDA graphs and the largest step's activations (on CPU: of available system
    # memory), as TensorRT-LLM's free_gpu_memory_fraction.
    max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    # TensorRT-LLM's name. "auto": the model's dtype; "fp8": E4M3, one byte per element, so the same
    # memory holds twice bf16's tokens (per-layer scales, 1.0 without calibrated ones).
    dtype: str = "auto"

    def __post_init__(self):
        if self.tokens_per_block < 1 or self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"kv_cache_config.tokens_per_block must be a power of two, got {self.tokens_per_block}")
        if self.max_tokens is not None and self.max_tokens < self.tokens_per_block:
            raise ValueError(f"kv_cache_config.max_tokens must be at least tokens_per_block, got {self.max_tokens}")
        if not 0.0 < self.free_gpu_memory_fraction <= 1.0:
            raise ValueError("kv_cache_config.free_gpu_memory_fraction must be in (0, 1]")
        if self.dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_config.dtype must be auto or fp8, got {self.dtype!r}")


@dataclass
class SpeculativeConfig:
    """TensorRT-LLM's NGramDecodingConfig and DraftTargetDecodingConfig names. The next tokens are
    guessed, and the model checks the guesses in the step that computes the last token
    (app/engine/speculative.py). NGram (prompt lookup): guessed by finding the sequence's last n-gram
    earlier in its own tokens. DraftTarget: guessed by a smaller model with the same tokenizer,
    `speculative_model` (an HF directory, a .gguf file or an embedded alias; TensorRT-LLM's older
    name `speculative_model_dir` is taken too), run greedily (app/engine/draft_model.py)."""

    decoding_type: str = "NGram"
    max_draft_len: int = 4  # tokens guessed, and checked, per sequence per step
    max_matching_ngram_size: int = 3  # NGram: the longest tail looked up; shorter ones are tried after it
    speculative_model: str | None = None  # DraftTarget: the draft model
    speculative_model_dir: str | None = None

    def __post_init__(self):
        if self.decoding_type not in ("NGram", "DraftTarget"):
            raise ValueError(f"speculative_config.decoding_type {self.decoding_type!r} is not supported by the "
                             "torch engine (NGram, DraftTarget)")
        for name, most in (("max_draft_len", 32), ("max_matching_ngram_size", 16)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {most}], got {value!r}")
        if self.speculative_model and self.speculative_model_dir:
            raise ValueError("speculative_config: give speculative_model or speculative_model_dir, not both")
        self.speculative_model = self.speculative_model or self.speculative_model_dir
        self.speculative_model_dir = None
        if self.speculative_model is not None and not isinstance(self.speculative_model, str):
            raise ValueError("speculative_config.speculative_model must be a path or a model alias (a string)")
        if self.drafts_with_model and not self.speculative_model:
            raise ValueError("speculative_config.speculative_model is required with decoding_type DraftTarget "
                             "(the draft model's directory)")
        if not self.drafts_with_model and self.speculative_model:
            raise ValueError("speculative_config.speculative_model is read with decoding_type DraftTarget only")

    @property
    def drafts_with_model(self) -> bool:
        return self.decoding_type == "DraftTarget"


# A request's logits cross the DAG in one data-plane frame (app/channel.py: at most 256 MiB).
MAX_LOGITS_FLOATS = 1 << 24


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # an alias of an embedded model, an HF directory, or a .gguf file
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    max_batch_size: int = 64  # sequences in flight (each beam counts)
    max_num_tokens: int = 2048  # tokens computed per step (the in-flight batcher's token budget)
    max_seq_len: int | None = None  # prompt + output; default: the model's limit
    enable_chunked_prefill: bool = True
    scheduler_policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT
    batching_type: BatchingType = BatchingType.INFLIGHT
    max_beam_width: int = 4
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    seed: int = 0  # seeds the sampler for requests that bring no seed of their own
    max_loras: int = 8  # adapters resident on the device at once (lora_cache_gpu_memory_fraction's role); 0: none
    max_cpu_loras: int = 64  # adapters kept loaded on the host (lora_cache_host_memory_bytes' role)
    max_lora_rank: int = 64
    cuda_graphs: bool = True  # CUDA only: replay decode steps from graphs (batch-size buckets)
    # CUDA only, with cuda_graphs: steps that carry prefill chunks, up to this many tokens, replay the
    # model's trunk from graphs cut at each attention call (app/engine/piecewise_graphs.py); 0: op by op.
    piecewise_graph_max_tokens: int = 512
    # TensorRT-LLM's name. Overlap queues step k + 1 on the device before step k's tokens are read
    # back (one CUDA device; requests with penalties, bad words or beams step without it).
    disable_overlap_scheduler: bool = False
    # With overlap: the serving loop goes on taking requests until just before the step computing ends,
    # then plans the next one, so a request that arrives meanwhile makes the next step, not the one
    # after (app/engine/step_clock.py). Off by default: with FP8 at 256 streams (H200), where the
    # host's work is near the device's step, Serve delivered 12-16% less with it and a higher TTFT
    # (docs/PERFORMANCE.md, "The engine's host work at FP8 speed").
    late_planning: bool = False
    load_format: str = "auto"  # "dummy": random weights from config.json alone (speed runs without downloads)
    # "fp8": the decoder layers' linears in FP8 E4M3 (per-channel weight scales, per-token activation
    # scales, torch._scaled_mm), quantized from the 16-bit weights at load (fast FP8 matmuls: Hopper on).
    quantization: str | None = None
    max_input_len: int | None = None  # longest prompt accepted (tokens); default: max_seq_len - 1
    max_output_len: int | None = None  # largest max_tokens accepted; default: what max_seq_len leaves
    # What one request may ask for, so that no single request can hold the engine (or every step's
    # sampler) for long: 10,000 return sequences or 60,000 bad words are refused, not run.
    max_return_sequences: int = 16  # n, best_of, num_return_sequences
    max_stop_words: int = 64  # stop sequences, and bad-word sequences, per request
    max_stop_word_len: int = 256  # tokens per stop or bad word (characters, for words sent as text)
    max_logprobs: int = 20  # top_logprobs per output token (OpenAI's own cap); 0 refuses them
    # Raw logits one request may ask back (return_context_logits: prompt x vocab; plus
    # return_generation_logits: max_tokens x outputs x vocab): 16 MiB of float32, which every stage
    # holds whole at some point; about 85 tokens of SmolLM2's vocabulary, 32 of Llama 3's.
    max_logits_floats: int = 1 << 22
    # Speculative decoding (None: off). Greedy and sampled requests without penalties, guides or
    # beams speculate; their steps are not overlapped, since a guess needs the last token on the host.
    speculative_config: SpeculativeConfig | None = None
    # Ranks = tp x pp: rank 0 is the engine's own process, the others are started by a WorkerLauncher.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if isinstance(self.kv_cache_config, dict):
            self.kv_cache_config = KvCacheConfig(**self.kv_cache_config)
        if isinstance(self.speculative_config, dict):
            unknown = set(self.speculative_config) - {f for f in SpeculativeConfig.__dataclass_fields__}
            if unknown:
                raise ValueError(f"speculative_config.{sorted(unknown)[0]} is not supported by the torch engine "
                                 "(decoding_type, max_draft_len, max_matching_ngram_size, speculative_model, "
                                 "speculative_model_dir)")
            self.speculative_config = SpeculativeConfig(**self.speculative_config)
        self.scheduler_policy = SchedulerPolicy(self.scheduler_policy)
        self.batching_type = BatchingType(self.batching_type)
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be at least 0 (0: no adapters), got {self.max_loras}")
        for name in ("max_batch_size", "max_num_tokens", "max_beam_width", "max_cpu_loras",
                     "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size", "max_return_sequences",
                     "max_stop_words", "max_stop_word_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.max_logits_floats <= MAX_LOGITS_FLOATS:
            raise ValueError(f"max_logits_floats must be in [0, {MAX_LOGITS_FLOATS}], got {self.max_logits_floats}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be at least 0, got {self.max_logprobs}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
