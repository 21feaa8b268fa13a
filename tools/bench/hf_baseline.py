"""transformers' own generation on the same workload: sequential generate and static batches."""
from __future__ import annotations

import time

import torch

from tools.bench.report import RequestTiming, RunResult, summarize
from tools.bench.workload import Workload


def load_hf(model_dir, dtype: torch.dtype, device: str, dummy: bool = False):
    """The model as transformers loads it; with `dummy`, its own random init of the config's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if dummy:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _first(ids):
    return ids[0] if isinstance(ids, list) else ids


def _kwargs(model, wl: Workload) -> dict:
    kw = dict(max_new_tokens=wl.output_len, do_sample=False, pad_token_id=_first(model.generation_config.eos_token_id))
    if wl.ignore_eos:
        kw["min_new_tokens"] = wl.output_len
    return kw


def _new_tokens(row: torch.Tensor, eos) -> int:
    eos = set(eos if isinstance(eos, list) else [eos])
    ids = row.tolist()
    return next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))


@torch.inference_mode()
def run_sequential(model, wl: Workload, limit: int) -> RunResult:
    """One request at a time; the first `limit` requests (its tokens/s does not depend on how many)."""
    device = model.device
    model.generate(torch.tensor([wl.prompts[0][:8]], device=device), max_new_tokens=2, do_sample=False)  # warm-up
    timings = []
    start = time.perf_counter()
    for prompt in wl.prompts[:limit]:
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([prompt], device=device), **_kwargs(model, wl))
        e2e = time.perf_counter() - t0
        timings.append(RequestTiming(ttft_s=float("nan"), e2e_s=e2e,
                                     output_tokens=_new_tokens(out[0, len(prompt):], model.generation_config.eos_token_id),
                                     itl_s=[]))
    result = summarize("hf sequential", time.perf_counter() - start, timings, sum(map(len, wl.prompts[:limit])))
    result.ttft_ms = None
    return result


@torch.inference_mode()
def run_static_batches(model, wl: Workload) -> RunResult:
    """Batches of `concurrency` requests, left-padded, each batch run to its longest member."""
    device = model.device
    pad = _first(model.generation_config.eos_token_id)
    timings = []
    start = time.perf_counter()
    for i in range(0, wl.num_requests, wl.concurrency):
        batch = wl.prompts[i:i + wl.concurrency]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        t0 = time.perf_counter()
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **_kwargs(model, wl))
        e2e = time.perf_counter() - t0
        for row in out[:, width:]:
            timings.append(RequestTiming(float("nan"), e2e, _new_tokens(row, model.generation_config.eos_token_id), []))
    result = summarize(f"hf static batch {wl.concurrency}", time.perf_counter() - start, timings,
                       sum(map(len, wl.prompts)))
    result.ttft_ms = None
    return result


def run_generate_batch(model, wl: Workload) -> RunResult:
    """transformers' continuous batching (`generate_batch`, paged attention): every request at once;
    it reports no per-request timings, so only the wall time counts. Not under inference_mode: its
    generation thread updates tensors in place, which inference tensors refuse."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=wl.output_len, do_sample=False,
                              eos_token_id=_first(model.generation_config.eos_token_id),
                              pad_token_id=_first(model.generation_config.eos_token_id))
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=wl.prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - start
    timings = [RequestTiming(float("nan"), wall, len(out.generated_tokens), []) for out in outputs.values()]
    if not sum(t.output_tokens for t in timings):
        raise RuntimeError("generate_batch produced no tokens (its log says why)")
    result = summarize(f"hf generate_batch {wl.num_requests}", wall, timings, sum(map(len, wl.prompts)))
    result.ttft_ms = None
    return result
