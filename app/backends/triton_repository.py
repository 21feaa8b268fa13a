"""A Triton model repository for the TensorRT-LLM backend's `tensorrt_llm` model, written from our
config: what the seeds do by copying inflight_batcher_llm and running fill_template.py by hand.

Only the ids-in/ids-out model is written: our tokenizer and detokenizer stages replace the seeds'
preprocessing and postprocessing models, and the ensemble/BLS glue is our DAG. Names, types and
shapes follow the backend's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt. Guided
decoding is turned on as its docs/guided_decoding.md does for the C++ backend: the xgrammar
tokenizer info (TensorRT-LLM's generate_xgrammar_tokenizer_info.py) is written beside config.pbtxt.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from app.config import ServiceConfig
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.model_dir import cache_root, resolve_model_dir
from app.engine.model_loader import read_model_config

# (name, data type, dims) of the inputs we send; every one optional but the first three.
INPUTS = [
    ("input_ids", "TYPE_INT32", "[ -1 ]"), ("input_lengths", "TYPE_INT32", "[ 1 ]"),
    ("request_output_len", "TYPE_INT32", "[ 1 ]"), ("end_id", "TYPE_INT32", "[ 1 ]"),
    ("pad_id", "TYPE_INT32", "[ 1 ]"), ("stop_words_list", "TYPE_INT32", "[ 2, -1 ]"),
    ("bad_words_list", "TYPE_INT32", "[ 2, -1 ]"), ("beam_width", "TYPE_INT32", "[ 1 ]"),
    ("temperature", "TYPE_FP32", "[ 1 ]"), ("runtime_top_k", "TYPE_INT32", "[ 1 ]"),
    ("runtime_top_p", "TYPE_FP32", "[ 1 ]"), ("len_penalty", "TYPE_FP32", "[ 1 ]"),
    ("repetition_penalty", "TYPE_FP32", "[ 1 ]"), ("min_tokens", "TYPE_INT32", "[ 1 ]"),
    ("presence_penalty", "TYPE_FP32", "[ 1 ]"), ("frequency_penalty", "TYPE_FP32", "[ 1 ]"),
    ("seed", "TYPE_UINT64", "[ 1 ]"), ("return_log_probs", "TYPE_BOOL", "[ 1 ]"),
    ("return_perf_metrics", "TYPE_BOOL", "[ 1 ]"), ("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]"),
    ("stop", "TYPE_BOOL", "[ 1 ]"), ("streaming", "TYPE_BOOL", "[ 1 ]"),
    ("num_return_sequences", "TYPE_INT32", "[ 1 ]"), ("lora_task_id", "TYPE_UINT64", "[ 1 ]"),
    ("lora_weights", "TYPE_FP16", "[ -1, -1 ]"), ("lora_config", "TYPE_INT32", "[ -1, 3 ]"),
    ("guided_decoding_guide_type", "TYPE_STRING", "[ 1 ]"), ("guided_decoding_guide", "TYPE_STRING", "[ 1 ]"),
    ("return_context_logits", "TYPE_BOOL", "[ 1 ]"), ("return_generation_logits", "TYPE_BOOL", "[ 1 ]"),
    ("embedding_bias", "TYPE_FP32", "[ -1 ]"),
]
REQUIRED = {"input_ids", "input_lengths", "request_output_len"}
RAGGED = {"input_ids", "stop_words_list", "bad_words_list", "lora_weights", "lora_config",
          "guided_decoding_guide_type", "guided_decoding_guide", "embedding_bias"}
TOKENIZER_INFO = "xgrammar_tokenizer_info.json"

OUTPUTS = [
    ("output_ids", "TYPE_INT32", "[ -1, -1 ]"), ("sequence_length", "TYPE_INT32", "[ -1 ]"),
    ("cum_log_probs", "TYPE_FP32", "[ -1 ]"), ("output_log_probs", "TYPE_FP32", "[ -1, -1 ]"),
    ("sequence_index", "TYPE_INT32", "[ 1 ]"), ("kv_cache_alloc_new_blocks", "TYPE_INT32", "[ 1 ]"),
    ("kv_cache_reused_blocks", "TYPE_INT32", "[ 1 ]"), ("kv_cache_alloc_total_blocks", "TYPE_INT32", "[ 1 ]"),
    ("arrival_time_ns", "TYPE_INT64", "[ 1 ]"), ("first_scheduled_time_ns", "TYPE_INT64", "[ 1 ]"),
    ("first_token_time_ns", "TYPE_INT64", "[ 1 ]"), ("last_token_time_ns", "TYPE_INT64", "[ 1 ]"),
    # Filled only for requests that ask (return_*_logits) of an engine built to gather them
    # (trtllm-build --gather_context_logits / --gather_generation_logits: nothing in this file).
    ("context_logits", "TYPE_FP32", "[ -1, -1 ]"), ("generation_logits", "TYPE_FP32", "[ -1, -1, -1 ]"),
]


def backend_parameters(config: ServiceConfig, tokenizer_info: str | None = None) -> dict[str, str]:
    """The tensorrt_llm model's `parameters`, in the seeds' key names, from our config; guided
    decoding on when given the path of the xgrammar tokenizer info."""
    section, kv = config.triton, config.kv_cache_config
    params = {
        "gpt_model_type": "V1" if config.batching_type is BatchingType.STATIC else "inflight_fused_batching",
        "gpt_model_path": section.engine_dir,
        "batch_scheduler_policy": "max_utilization" if config.scheduler_policy is SchedulerPolicy.MAX_UTILIZATION
        else "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": str(kv.free_gpu_memory_fraction),
        "enable_kv_cache_reuse": str(kv.enable_block_reuse).lower(),
        "enable_chunked_context": str(config.enable_chunked_prefill).lower(),
        "max_beam_width": str(config.max_beam_width),
        "exclude_input_in_output": "true",
        "lora_cache_optimal_adapter_size": str(section.lora_cache_optimal_adapter_size),
        "lora_cache_max_adapter_size": str(section.lora_cache_max_adapter_size),
        "lora_cache_gpu_memory_fraction": str(section.lora_cache_gpu_memory_fraction),
        "lora_cache_host_memory_bytes": str(section.lora_cache_host_memory_bytes),
    }
    if kv.max_tokens is not None:
        params["max_tokens_in_paged_kv_cache"] = str(kv.max_tokens)
    if tokenizer_info is not None:
        params["guided_decoding_backend"] = "xgrammar"
        params["xgrammar_tokenizer_info_path"] = tokenizer_info
    return params


def xgrammar_tokenizer_info(model_dir: Path) -> dict | None:
    """What the backend's xgrammar builds its vocabulary from, as TensorRT-LLM's
    generate_xgrammar_tokenizer_info.py writes it: the tokens by id, the fast tokenizer's JSON and
    the end ids (all the model's, as the torch engine's grammars take). None for a tokenizer with no
    fast form: the model is then written without guided decoding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    if not tokenizer.is_fast:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return {"encoded_vocab": [token for token, _ in vocab], "tokenizer_str": tokenizer.backend_tokenizer.to_str(),
            "stop_token_ids": list(read_model_config(model_dir).eos_token_ids)}


def _tensor(name: str, dtype: str, dims: str, *, optional: bool, ragged: bool) -> str:
    lines = [f'    name: "{name}"', f"    data_type: {dtype}", f"    dims: {dims}"]
    if dims == "[ 1 ]" and not ragged:
        lines.append("    reshape: { shape: [ ] }")
    if ragged:
        lines.append("    allow_ragged_batch: true")
    if optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def render_config(config: ServiceConfig, tokenizer_info: str | None = None) -> str:
    """config.pbtxt of the tensorrt_llm model, decoupled (streaming) as our engine stage needs."""
    inputs = ",\n".join(_tensor(n, t, d, optional=n not in REQUIRED, ragged=n in RAGGED) for n, t, d in INPUTS)
    outputs = ",\n".join("  {\n" + f'    name: "{n}"\n    data_type: {t}\n    dims: {d}' + "\n  }"
                         for n, t, d in OUTPUTS)
    params = "\n".join(f'parameters: {{\n  key: "{k}"\n  value: {{ string_value: "{v}" }}\n}}'
                       for k, v in backend_parameters(config, tokenizer_info).items())
    section = config.triton
    return (f'name: "{section.model_name}"\nbackend: "tensorrtllm"\nmax_batch_size: {config.max_batch_size}\n\n'
            "model_transaction_policy {\n  decoupled: true\n}\n\n"
            f"dynamic_batching {{\n  preferred_batch_size: [ {config.max_batch_size} ]\n"
            f"  max_queue_delay_microseconds: {section.max_queue_delay_microseconds}\n}}\n\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n" + params + "\n")


def write_model_repository(config: ServiceConfig, root: str | Path | None = None) -> Path:
    """Write <root>/<model_name>/config.pbtxt, its version folder and the xgrammar tokenizer info;
    the default root is a folder named by the hash of the config and the model, so replicas of one
    config share it (each file is replaced whole: a replica starting meanwhile reads old or new)."""
    tokenizer_dir = resolve_model_dir(config.model)
    if root is None:  # hashed without the tokenizer info's path, which follows from the root
        key = render_config(config) + str(tokenizer_dir)
        root = cache_root() / "triton-repositories" / hashlib.sha256(key.encode()).hexdigest()[:16]
    model_dir = Path(root).resolve() / config.triton.model_name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    info = xgrammar_tokenizer_info(tokenizer_dir)
    if info is not None:
        _write_whole(model_dir / TOKENIZER_INFO, json.dumps(info))
    _write_whole(model_dir / "config.pbtxt", render_config(config, str(model_dir / TOKENIZER_INFO) if info else None))
    return Path(root)


def _write_whole(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)
