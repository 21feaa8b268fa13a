"""The model config file (configs/*.yaml): one pydantic schema, validated once at start-up.

Engine keys mirror TensorRT-LLM's model.yaml; their defaults come from the engine's own dataclasses,
so each default lives in one place. The `serve` section holds Ray Serve options per stage.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.engine.config import MAX_LOGITS_FLOATS, BatchingType, EngineConfig, KvCacheConfig, SchedulerPolicy


class ConfigError(ValueError):
    """A config file that cannot start the service; the message is one sentence naming the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class KvCacheSection(_Strict):
    enable_block_reuse: bool = KvCacheConfig.enable_block_reuse
    tokens_per_block: int = Field(KvCacheConfig.tokens_per_block, ge=1, le=1024)
    max_tokens: int | None = Field(KvCacheConfig.max_tokens, ge=1)
    free_gpu_memory_fraction: float = Field(KvCacheConfig.free_gpu_memory_fraction, gt=0.0, le=1.0)
    dtype: Literal["auto", "fp8"] = Field(KvCacheConfig.dtype, description="auto: the model's dtype; fp8: E4M3, "
                                          "twice the tokens in the same memory (backends torch and trtllm)")


class AutoscalingSection(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0, description="window the ongoing-request average is taken over")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report their load")


# Serve's replica settings for a streaming pipeline, taken from what RAY_SERVE_THROUGHPUT_OPTIMIZED
# turns on (it also moves replica logs off stderr, which these leave alone). Each replica runs our
# handlers, and its handles' router, on its own event loop: no hop to a user-code thread or a
# router loop per call. Calls between stages go over gRPC instead of Ray actor calls
# (deployments/handles.py applies the switch to the handles a stage is given), with no gRPC limit
# on message size: the Ingress's max_request_bytes bounds what a request carries. On an H200 (8B
# shape, 256 streams arriving at once) the loops took the DAG from 0.88 to 0.92 of the engine and
# gRPC from 0.93 to 0.96, each measured in one call (docs/PERFORMANCE.md). A stage's env_vars
# override them.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
               "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "-1",
               "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}


class StageSection(_Strict):
    """Ray Serve options of one deployment of the DAG."""

    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingSection | None = None
    max_ongoing_requests: int = Field(256, ge=1, description="requests a replica works on at once")
    max_queued_requests: int = Field(1024, ge=-1, description="requests waiting for a replica; -1: unbounded")
    num_cpus: float = Field(0.5, ge=0)
    # A stage writes its data connection (app/channel.py) at most this often once 16 streams are open;
    # a first or last delta goes at once.
    stream_interval_ms: float = Field(50.0, ge=0.0, le=1000.0)
    env_vars: dict[str, str] = Field(default_factory=dict, description="environment of this stage's replicas")
    # A replica being replaced (redeploy, downscale) finishes its requests for at most this long.
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0)

    def deployment_options(self) -> dict:
        actor = {"num_cpus": self.num_cpus, "runtime_env": {"env_vars": {**REPLICA_ENV, **self.env_vars}}}
        options = {"max_ongoing_requests": self.max_ongoing_requests,
                   "max_queued_requests": self.max_queued_requests, "ray_actor_options": actor,
                   "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.model_dump()
        else:
            options["num_replicas"] = self.num_replicas
        return options


class ServeSection(_Strict):
    ingress: StageSection = StageSection(num_cpus=0.25)
    tokenizer: StageSection = StageSection(num_cpus=0.25)
    engine: StageSection = StageSection(num_cpus=1.0)
    detokenizer: StageSection = StageSection(num_cpus=0.25)


class RoutingSection(_Strict):
    """How requests pick an engine replica (with several). Adapter requests go to replicas that hold
    their adapter first (Serve multiplexing); among those, with prefix affinity, to the replica that
    last served the longest run of the prompt's leading KV blocks, so its cached blocks are reused."""

    prefix_affinity: bool = True
    max_imbalance: int = Field(8, ge=0, description="prefer the prefix's replica unless it has this many more "
                                                    "requests in flight than the least loaded candidate")
    max_tracked_blocks: int = Field(200_000, ge=1, description="prefix blocks remembered per router (LRU)")


class TritonSection(_Strict):
    """backend: triton: Triton's in-process server running the TensorRT-LLM backend's tensorrt_llm model."""

    engine_dir: str = Field(description="the built TensorRT-LLM engine (the model's gpt_model_path)")
    model_repository: str | None = Field(None, description="an existing repository; default: written from this config")
    model_name: str = "tensorrt_llm"
    backend_directory: str = "/opt/tritonserver/backends"
    start_timeout_s: float = Field(600.0, gt=0)
    max_queue_delay_microseconds: int = Field(0, ge=0)
    lora_cache_optimal_adapter_size: int = Field(8, ge=1)
    lora_cache_max_adapter_size: int = Field(64, ge=1)
    lora_cache_gpu_memory_fraction: float = Field(0.05, gt=0.0, le=1.0)
    lora_cache_host_memory_bytes: int = Field(1 << 30, ge=0)


class ServiceConfig(_Strict):
    """One model served: engine keys (model.yaml spirit) plus per-stage Serve options."""

    model: str = EngineConfig.model
    served_model_name: str | None = Field(None, description="name on the routes; default: from `model`")
    backend: Literal["torch", "trtllm", "triton"] = "torch"
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = EngineConfig.dtype
    load_format: Literal["auto", "dummy"] = Field(EngineConfig.load_format, description="dummy: random weights "
                                                  "from config.json alone, for speed runs without downloads")
    quantization: Literal["fp8"] | None = Field(EngineConfig.quantization, description="backend torch: fp8 "
                                                "quantizes the decoder layers' linears at load (E4M3, per-channel "
                                                "weight and per-token activation scales)")
    device: str = EngineConfig.device
    max_batch_size: int = Field(EngineConfig.max_batch_size, ge=1)
    max_num_tokens: int = Field(EngineConfig.max_num_tokens, ge=1)
    max_seq_len: int | None = Field(EngineConfig.max_seq_len, ge=2)
    enable_chunked_prefill: bool = EngineConfig.enable_chunked_prefill
    scheduler_policy: SchedulerPolicy = EngineConfig.scheduler_policy
    batching_type: BatchingType = EngineConfig.batching_type
    max_beam_width: int = Field(EngineConfig.max_beam_width, ge=1)
    max_loras: int = Field(EngineConfig.max_loras, ge=1, description="adapters resident on the device at once")
    max_cpu_loras: int = Field(EngineConfig.max_cpu_loras, ge=1, description="adapters kept on the host")
    max_lora_rank: int = Field(EngineConfig.max_lora_rank, ge=1)
    lora_roots: list[str] = Field(default_factory=list, description="directories adapters may be loaded from")
    lora_adapters: dict[str, str] = Field(default_factory=dict, description="adapter name -> path (under a root)")
    kv_cache_config: KvCacheSection = KvCacheSection()
    engine_process: bool | None = Field(None, description="backend torch, one device: run the engine loop in a "
                                        "process of its own, away from the replica's request traffic and its GIL; "
                                        "default: on for CUDA, off for CPU (a second process per replica)")
    cuda_graphs: bool = Field(EngineConfig.cuda_graphs, description="CUDA: replay decode steps from graphs")
    piecewise_graph_max_tokens: int = Field(
        EngineConfig.piecewise_graph_max_tokens, ge=0,
        description="CUDA, with cuda_graphs: steps carrying prefill chunks, up to this many tokens, replay the "
                    "model from graphs cut at each attention call; 0: such steps run op by op")
    disable_overlap_scheduler: bool = Field(EngineConfig.disable_overlap_scheduler, description="read each step "
                                            "back before queuing the next (overlap is on by default on CUDA)")
    late_planning: bool = Field(EngineConfig.late_planning, description="backend torch, with overlap: plan each step just "
                                "before the one computing ends, so requests arriving meanwhile make it (off by "
                                "default: each step is planned as soon as the step before is read back)")
    seed: int = EngineConfig.seed
    max_tokens_default: int | None = Field(None, ge=1, description="max_tokens when a request names none; none: up "
                                           "to the end of the context, as OpenAI's API does (max_output_len caps it; "
                                           "GUARANTEED_NO_EVICT reserves KV blocks for all of it)")
    max_input_len: int | None = Field(EngineConfig.max_input_len, ge=1, description="longest prompt accepted (tokens)")
    max_output_len: int | None = Field(EngineConfig.max_output_len, ge=1, description="largest max_tokens accepted")
    max_return_sequences: int = Field(EngineConfig.max_return_sequences, ge=1, description="largest n, best_of "
                                      "or num_return_sequences a request may ask for")
    max_stop_words: int = Field(EngineConfig.max_stop_words, ge=1, description="most stop words, and most bad "
                                "words, one request may send")
    max_stop_word_len: int = Field(EngineConfig.max_stop_word_len, ge=1, description="longest stop or bad word "
                                   "(characters as text, tokens as ids)")
    max_logits_floats: int = Field(EngineConfig.max_logits_floats, ge=0, le=MAX_LOGITS_FLOATS,
                                   description="raw logits one request may ask back (return_context_logits, "
                                               "return_generation_logits), in float32 values")
    max_logprobs: int = Field(EngineConfig.max_logprobs, ge=0, description="most top_logprobs (likeliest tokens "
                              "returned with each output token) a request may ask for")
    api_key: str | None = Field(None, description="clients send 'Authorization: Bearer <key>' on every route "
                                "but health; the LLM_SERVE_API_KEY environment variable sets it too")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    trust_remote_code: bool = False
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="the format /v1/chat/completions finds tool calls in (app/protocol/tools.py); "
                            "auto: read from the chat template")
    step_timeout_s: float = Field(60.0, gt=0, description="a replica whose engine step runs longer is unhealthy")
    cuda_graph_config: dict | None = Field(None, description="backend trtllm: passed to tensorrt_llm.LLM as is")
    speculative_config: dict | None = Field(None, description="backend torch: n-gram or draft-model speculation, "
                                            "TensorRT-LLM's NGramDecodingConfig / DraftTargetDecodingConfig keys "
                                            "(app/engine/config.py); backend trtllm: "
                                            "passed to tensorrt_llm.LLM as is")
    llm_args: dict = Field(default_factory=dict, description="backend trtllm: further tensorrt_llm.LLM arguments")
    triton: TritonSection | None = None
    cpu_threads: int | None = Field(None, ge=1, description="torch threads of a CPU engine; default: every CPU the "
                                    "process may run on (Ray would otherwise give it one per reserved CPU)")
    serve: ServeSection = ServeSection()
    routing: RoutingSection = RoutingSection()
    check_placement: bool = Field(True, description="refuse to start when the cluster cannot hold one engine "
                                  "replica's placement group; false on a cluster whose autoscaler adds nodes")

    @model_validator(mode="after")
    def _keys_together(self) -> ServiceConfig:
        trtllm_only = [k for k in ("cuda_graph_config", "llm_args") if getattr(self, k)]
        if self.quantization and self.backend != "torch":
            raise ValueError("quantization is read by backend torch (a TensorRT-LLM engine is quantized when it is "
                             "built: ModelOpt, or llm_args' quant_config for backend trtllm)")
        if self.kv_cache_config.dtype == "fp8" and self.backend == "triton":
            raise ValueError("kv_cache_config.dtype fp8 is read by backends torch and trtllm (a built TensorRT-LLM "
                             "engine's KV cache dtype is fixed when it is built: quantize.py --kv_cache_dtype fp8)")
        if self.speculative_config and self.backend == "triton":
            raise ValueError("speculative_config is read by backends torch and trtllm (a built TensorRT-LLM "
                             "engine's speculation is fixed when it is built)")
        if trtllm_only and self.backend != "trtllm":
            raise ValueError(f"{trtllm_only[0]} is read by backend trtllm only "
                             f"(this config's backend is {self.backend})")
        if self.backend == "triton" and self.triton is None:
            raise ValueError("backend triton needs a 'triton' section with engine_dir (the built TensorRT-LLM engine)")
        if None not in (self.max_output_len, self.max_tokens_default) and self.max_tokens_default > self.max_output_len:
            raise ValueError(f"max_tokens_default ({self.max_tokens_default}) exceeds max_output_len "
                             f"({self.max_output_len})")
        if self.world_size > 1 and self.backend == "triton":
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs backend torch "
                             "or trtllm; the triton backend's in-process server runs one device per replica")
        return self

    @property
    def runs_engine_process(self) -> bool:
        if self.backend != "torch" or self.world_size > 1:  # a parallel engine's ranks are Ray actors
            return False
        return self.engine_process if self.engine_process is not None else self.device != "cpu"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def engine_deployment_options(self) -> dict:
        """The engine stage's Serve options. A replica owns its devices: one GPU for a single-device
        engine; for TP x PP a placement group of one bundle per rank (a GPU, or a CPU on a CPU
        engine), bundle 0 also holding the replica's CPU. The torch backend's replica is rank 0 and
        starts the other ranks in bundles 1..N-1; TensorRT-LLM's Ray orchestrator places all its
        ranks itself. TP stays on one node (STRICT_PACK); pipeline stages may cross nodes (PACK)."""
        options = self.serve.engine.deployment_options()
        actor = options["ray_actor_options"]
        if self.routing.prefix_affinity:
            options["request_router_config"] = {
                "request_router_class": "deployments.routing:PrefixAffinityRouter",
                "request_router_kwargs": {"block_size": self.kv_cache_config.tokens_per_block,
                                          "max_imbalance": self.routing.max_imbalance,
                                          "max_tracked_blocks": self.routing.max_tracked_blocks}}
        on_gpu = self.device != "cpu"
        if self.world_size == 1:
            if on_gpu:
                actor["num_gpus"] = 1
            return options
        device = {"GPU": 1} if on_gpu else {"CPU": 1}
        options["placement_group_bundles"] = [{**device, "CPU": actor["num_cpus"]}] + [device] * (self.world_size - 1)
        options["placement_group_strategy"] = "PACK" if self.pipeline_parallel_size > 1 else "STRICT_PACK"
        if on_gpu and self.backend == "torch":
            actor["num_gpus"] = 1  # the replica itself is rank 0, on bundle 0's GPU
        return options

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name.removesuffix(".gguf")

    def engine_config(self) -> EngineConfig:
        """The engine's config: every EngineConfig field has a key of the same name here."""
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        values["kv_cache_config"] = KvCacheConfig(**self.kv_cache_config.model_dump())
        if self.backend != "torch":  # TensorRT-LLM's own speculation keys, read by that backend
            values["speculative_config"] = None
        if not (self.lora_roots or self.lora_adapters):  # no adapter can ever come: reserve no slots for one
            values["max_loras"] = 0
        return EngineConfig(**values)


def load_config(path: str | Path) -> ServiceConfig:
    """Read and validate a config file; any problem becomes one ConfigError sentence."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc})") from None
    return parse_config(data, str(path))


def parse_config(data: dict, source: str = "config") -> ServiceConfig:
    try:
        config = ServiceConfig.model_validate(data)
        config.engine_config()  # the engine's own checks (powers of two, ranges)
        return config
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"{source}: unknown key '{key}'") from None
        if not err["loc"]:  # a check across keys (a model validator): its message is the sentence
            raise ConfigError(f"{source}: {err['msg'].removeprefix('Value error, ')}") from None
        raise ConfigError(f"{source}: key '{key}': {err['msg']} (got {err.get('input')!r})") from None
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
