"""The engine's CUDA kernels alone, on the device: checks each against a reference and times the
choices made in app/engine/models (decode launch shapes over bf16 and FP8 caches, fused add +
RMSNorm, varlen prefill against one SDPA per chunk, the grouped-GEMM mixture of experts against
running its experts one by one). Prints one table; `--json` writes every row.

    python -m tools.bench.kernels --json kernels.json [--only moe]
"""
from __future__ import annotations

import argparse
import inspect
import json

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from app.engine.models.attention import FP8_MAX, AttentionMetadata, PackedPrefills, dequantize, quantize
from app.engine.models.kernels import CudaKernels, TorchKernels, quantize_weight
from app.engine.models.moe import SparseMoE
from app.engine.models.triton_attention import launch_shape, paged_decode
from app.engine.models.triton_fused import add_rms_norm
from app.engine.parallel import SINGLE

SHAPES = {"llama-3.1-8b": dict(heads=32, kv_heads=8, head_dim=128, hidden=4096),
          "smollm2-135m": dict(heads=9, kv_heads=3, head_dim=64, hidden=576)}
ROWS: list[dict] = []
DECODE_SWEEP = [(tile, warps, stages) for tile in (32, 64, 128) for warps in (2, 4) for stages in (2, 3)]


def _row(**fields) -> None:
    ROWS.append(fields)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()), flush=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _random_cache(num_seqs: int, context: int, kv_heads: int, head_dim: int, block_size: int):
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks - 1, device="cuda")[:num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    return k, v, tables


def decode(shape: str, num_seqs: int, context: int, block_size: int) -> None:
    """The paged decode kernel over a bf16 cache and over the FP8 cache rounded from it, in the shape
    launch_shape picks and in a sweep of others, each replayed from a CUDA graph (as decode steps run:
    no host time in it); checked against float32 SDPA over the gathered blocks of that cache."""
    s = SHAPES[shape]
    k, v, tables = _random_cache(num_seqs, context, s["kv_heads"], s["head_dim"], block_size)
    q = torch.randn(num_seqs, s["heads"], s["head_dim"], device="cuda", dtype=torch.bfloat16)
    lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
    scale = s["head_dim"] ** -0.5
    k_scale, v_scale = (x.float().abs().amax().reshape(1) / FP8_MAX for x in (k, v))
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    few = min(num_seqs, 4)
    elements = 2 * num_seqs * context * s["kv_heads"] * s["head_dim"]
    for name, kc, vc, scales in (("bf16", k, v, None), ("fp8", k8, v8, (k_scale, v_scale))):
        keys, values = (dequantize(c, sc, torch.float32)[tables[:few].long()].flatten(1, 2)[:, :context].transpose(1, 2)
                        for c, sc in zip((kc, vc), scales or (1.0, 1.0)))
        ref = F.scaled_dot_product_attention(q[:few, :, None].float(), keys, values, scale=scale, enable_gqa=True)
        chosen = launch_shape(num_seqs * s["kv_heads"], scales is not None)
        for launch in [chosen] + [x for x in DECODE_SWEEP if x != chosen]:
            def run(launch=launch):
                return paged_decode(q, kc, vc, tables, lens, scale, kv_scales=scales, shape=launch)
            us = _graph_us(run)
            _row(kernel="paged_decode", cache=name, shape=shape, seqs=num_seqs, context=context, block=block_size,
                 tile=launch[0], warps=launch[1], stages=launch[2], chosen=launch == chosen, us=us,
                 gbps=elements * kc.element_size() / us / 1e3, rel_err=_rel_err(run()[:few], ref[:, :, 0]))


def add_norm(shape: str, tokens: int) -> None:
    hidden = SHAPES[shape]["hidden"]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    fused_residual = residual.clone()
    out = add_rms_norm(x, fused_residual, weight, 1e-5)
    expect_residual = residual + x
    err = _rel_err(out, F.rms_norm(expect_residual.float(), (hidden,), weight.float(), 1e-5))
    exact_residual = torch.equal(fused_residual, expect_residual)
    fused = do_bench(lambda: add_rms_norm(x, residual.clone(), weight, 1e-5), warmup=25, rep=200,
                     return_mode="median") * 1e3
    unfused = do_bench(lambda: F.rms_norm(residual.clone().add_(x), (hidden,), weight, 1e-5), warmup=25, rep=200,
                       return_mode="median") * 1e3
    _row(kernel="add_rms_norm", shape=shape, tokens=tokens, us=fused, unfused_us=unfused, rel_err=err,
         residual_exact=exact_residual)


def prefill(shape: str, chunks: list[tuple[int, int]], block_size: int = 32) -> None:
    """chunks: (new tokens, cached prefix tokens) per sequence. Varlen against one SDPA per chunk."""
    s = SHAPES[shape]
    h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
    contexts = [n + prefix for n, prefix in chunks]
    k_cache, v_cache, tables = _random_cache(len(chunks), max(contexts), kvh, d, block_size)
    total = sum(n for n, _ in chunks)
    q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    # The chunk's own keys and values sit in the cache already (the rotary kernel writes them first).
    slots = []
    for i, (n, prefix) in enumerate(chunks):
        pos = torch.arange(prefix, prefix + n, device="cuda")
        slot = tables[i].long()[pos // block_size] * block_size + pos % block_size
        slots.append(slot)
    slots = torch.cat(slots)
    k = k_cache.view(-1, kvh, d)[slots]
    v = v_cache.view(-1, kvh, d)[slots]
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    host_tables = tables.cpu().tolist()
    spec = [(start, n, n + prefix, host_tables[i][:-(-(n + prefix) // block_size)])
            for i, (start, (n, prefix)) in enumerate(zip(starts, chunks))]
    meta = AttentionMetadata(slots, 0, None, None, PackedPrefills.build(spec, block_size, torch.device("cuda")))
    per_chunk, varlen = TorchKernels(q.device, q.dtype), CudaKernels(q.device, q.dtype)
    scale = d ** -0.5
    ref = per_chunk.attention(q, k, v, k_cache, v_cache, meta, scale)
    out = varlen.attention(q, k, v, k_cache, v_cache, meta, scale)
    err = _rel_err(out, ref)
    flops = sum(4 * n * (n / 2 + prefix) * h * d for n, prefix in chunks)
    one_each = do_bench(lambda: per_chunk.attention(q, k, v, k_cache, v_cache, meta, scale), warmup=25, rep=200,
                        return_mode="median") * 1e3
    fused = do_bench(lambda: varlen.attention(q, k, v, k_cache, v_cache, meta, scale), warmup=25, rep=200,
                     return_mode="median") * 1e3
    _row(kernel="prefill", shape=shape, chunks=len(chunks), new=chunks[0][0], prefix=chunks[0][1], varlen_us=fused,
         per_chunk_us=one_each, varlen_tflops=flops / fused / 1e6, rel_err_vs_sdpa=err)


def _experts_one_by_one(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The baseline: each expert hit by the step runs over its own tokens (needs the hit list on the host)."""
    probs = F.softmax(moe.gate(x).float(), dim=-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        tokens, slot = torch.where(experts == expert)
        gate, up = F.linear(x[tokens], moe.w13[expert]).chunk(2, dim=-1)
        out.index_add_(0, tokens, (F.linear(F.silu(gate) * up, moe.w2[expert]) * weights[tokens, slot, None]).to(x.dtype))
    return out


def moe(tokens: int, experts: int = 8, top_k: int = 2, hidden: int = 4096, intermediate: int = 14336) -> None:
    """Mixtral-8x7B's layer shape, bf16, random weights; also the grouped path replayed from a CUDA graph."""
    layer = SparseMoE(hidden, intermediate, experts, top_k, torch.bfloat16, SINGLE).cuda()
    for weight in (layer.gate.weight, layer.w13, layer.w2):
        torch.nn.init.normal_(weight, std=hidden ** -0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        err = _rel_err(layer(x), _experts_one_by_one(layer, x))
        grouped, looped = do_bench(lambda: layer(x)), do_bench(lambda: _experts_one_by_one(layer, x))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x)
        replayed = do_bench(graph.replay)
    weight_bytes = 3 * hidden * intermediate * 2 * min(experts, tokens * top_k)
    _row(kernel="moe", tokens=tokens, experts=experts, top_k=top_k, grouped_ms=grouped, one_by_one_ms=looped,
         graph_ms=replayed, speedup=looped / grouped, graph_speedup=looped / replayed,
         weight_gbps=weight_bytes / replayed / 1e6, rel_err=err)


def _graph_us(fn) -> float:
    """Microseconds per call, ten calls replayed from one CUDA graph, as decode steps run: no host gaps
    between the kernels."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e2


def _cold_us(fn, weights: list) -> float:
    """Microseconds per call of fn(weight), replayed from one CUDA graph that calls it on each weight in
    turn (ten passes): together they are larger than the L2, so each call reads its weight from
    memory, as a decode step reads each layer's."""
    return _graph_us(lambda: [fn(w) for w in weights]) / len(weights)


def fp8(rows: int, outs: int, width: int) -> None:
    """One FP8 linear of the 8B shape: bf16 F.linear against the op-by-op FP8 path, one quantize kernel +
    _scaled_mm, and the weight-only kernel (few rows) in its chosen launch and a few others; errors
    against float32. Each reads one of enough copies of its weights to miss the L2."""
    from app.engine.models.layers import fp8_linear
    from app.engine.models.triton_fp8 import quantize_rows, weight_only_launch, weight_only_matmul

    copies = max(1, -(-256 * 2 ** 20 // (outs * width)))  # 256 MiB of FP8 weights, over four H200 L2s
    w16s = [torch.randn(outs, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5 for _ in range(copies)]
    pairs = [quantize_weight(w16) for w16 in w16s]
    w8, w_scale = pairs[0]
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ w8.float().t()) * w_scale

    def quantized(pair):
        q, s = quantize_rows(x)
        return torch._scaled_mm(q, pair[0].t(), scale_a=s, scale_b=pair[1], out_dtype=x.dtype)

    fields = dict(kernel="fp8_linear", rows=rows, outs=outs, width=width, l2_copies=copies,
                  bf16_us=_cold_us(lambda w: F.linear(x, w), w16s),
                  op_by_op_us=_cold_us(lambda pair: fp8_linear(x, *pair, None), pairs),
                  quantize_mm_us=_cold_us(quantized, pairs), quantize_mm_err=_rel_err(quantized(pairs[0]), ref),
                  op_by_op_err=_rel_err(fp8_linear(x, w8, w_scale, None), ref))
    if rows <= 128:
        chosen = weight_only_launch(outs, width, x.device)
        launches = {"chosen": chosen}
        for block_n, block_k, split_k, stages in ((128, 128, 4, 5), (128, 256, 1, 3), (64, 128, 4, 5), (128, 128, 8, 5),
                                                  (128, 128, 2, 5), (64, 256, 4, 3), (128, 128, 1, 5)):
            launches[f"{block_n}x{block_k}k{split_k}s{stages}"] = dict(block_n=block_n, block_k=block_k,
                                                                        split_k=split_k, num_stages=stages)
        for name, launch in launches.items():
            fields[f"wo_{name}_us"] = _cold_us(lambda pair, launch=launch: weight_only_matmul(x, *pair, None, **launch),
                                               pairs)
        fields["chosen_launch"] = chosen
        fields["weight_only_err"] = _rel_err(weight_only_matmul(x, w8, w_scale, None, **chosen), ref)
        fields["weight_only_tbps"] = outs * width / fields["wo_chosen_us"] / 1e6
    _row(**fields)


def lora(rows: int, outs: list[int], width: int, rank: int = 16) -> None:
    """One adapted linear of the 8B shape, every row on one adapter: the base bf16 matmul beside the
    adapter's shrink + expand (the y copy each call makes timed apart), replayed from graphs."""
    from app.engine.models.triton_lora import add_lora

    n = sum(outs)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    w = torch.randn(n, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    a = torch.randn(2, len(outs) * rank, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    b = torch.randn(2, n, rank, device="cuda", dtype=torch.bfloat16) * rank ** -0.5
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    order = torch.arange(rows, device="cuda")
    items = torch.tensor([[0, i, min(i + 16, rows)] for i in range(0, rows, 16)], dtype=torch.int32, device="cuda")
    base = F.linear(x, w)
    _row(kernel="lora", rows=rows, outs=n, width=width, rank=rank, base_us=_graph_us(lambda: F.linear(x, w)),
         lora_with_copy_us=_graph_us(lambda: add_lora(x, base.clone(), a, b, offsets, order, items, 16)),
         copy_us=_graph_us(base.clone))


def lora_launch(rows: int, adapters: int, outs: list[int], width: int, rank: int = 16) -> None:
    """One adapted linear of the 8B shape with `rows` spread over `adapters` slots (work items padded
    as a decode graph pads them), the shrink + expand under each launch setting (Launch): the shrink's
    over a grid, then the expand's one at a time, replayed from graphs; errors against the default's."""
    from types import SimpleNamespace

    from app.engine.lora import LoRASlots, max_work_items
    from app.engine.models.triton_lora import Launch, add_lora, shrink_block_k

    n = sum(outs)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    a = torch.randn(adapters + 1, len(outs) * rank, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    b = torch.randn(adapters + 1, n, rank, device="cuda", dtype=torch.bfloat16) * rank ** -0.5
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)  # the timed runs add into it
    slots = SimpleNamespace(num_slots=adapters)
    batch = LoRASlots.batch(slots, [1 + i % adapters for i in range(rows)], x.device, max_work_items(rows, adapters))
    settings = [Launch(block_k=k, programs=p, shrink_warps=w) for k in (64, 128, 256) for p in (256, 512, 1024)
                for w in (4, 8)]
    settings += [Launch(block_n=bn, expand_warps=w) for bn in (0, 128, 64, 32) for w in (4, 8) if (bn, w) != (0, 4)]
    # A setting whose K block add_lora caps for this width runs as another: named as it runs, once.
    block_width = max(16, triton.next_power_of_2(len(outs) * rank))
    settings = list(dict.fromkeys(s._replace(block_k=shrink_block_k(block_width, s)) for s in settings))
    ref = add_lora(x, torch.zeros_like(y), a, b, offsets, batch.order, batch.items, batch.block_m).float()
    fields = dict(kernel="lora_launch", rows=rows, adapters=adapters, outs=n, width=width, rank=rank,
                  items=batch.items.shape[0])
    for launch in settings:
        def run():
            return add_lora(x, y, a, b, offsets, batch.order, batch.items, batch.block_m, launch)
        err = _rel_err(add_lora(x, torch.zeros_like(y), a, b, offsets, batch.order, batch.items, batch.block_m, launch),
                       ref)
        key = "k{}p{}w{}_n{}w{}".format(launch.block_k, launch.programs, launch.shrink_warps, launch.block_n,
                                        launch.expand_warps)
        fields[key + "_us"] = _graph_us(run)
        if err > 1e-2:
            fields[key + "_err"] = err
    _row(**fields)


def lora_beside(rows: int, layers: int = 32) -> None:
    """A decode step's adapted linears at the 8B shape (one layer's weights, run `layers` times), one
    rank-16 adapter on every row, replayed from a graph: the base matmuls alone; with the adapter
    kernels after each matmul, in place; beside it on a side stream (SlotBatch.beside) with the
    delta then added by a kernel of its own; and beside it with the delta left to the next kernel,
    which reads the projection anyway (what the engine does up to BESIDE_MAX_ROWS)."""
    from types import SimpleNamespace

    from app.engine.lora import SlotBatch, rows_per_block

    modules = []
    for outs, width in (([4096, 1024, 1024], 4096), ([4096], 4096), ([14336, 14336], 4096), ([4096], 14336)):
        n = sum(outs)
        a = torch.randn(2, len(outs) * 16, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
        b = torch.randn(2, n, 16, device="cuda", dtype=torch.bfloat16) * 16 ** -0.5
        modules.append((len(modules), torch.randn(n, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5,
                        torch.randn(rows, width, device="cuda", dtype=torch.bfloat16), a, b,
                        [sum(outs[:i]) for i in range(len(outs))]))
    slots = SimpleNamespace(weights={key: (a, b, offsets) for key, _, _, a, b, offsets in modules},
                            side_stream=torch.cuda.Stream())
    block = rows_per_block(rows)
    items = torch.tensor([[1, i, rows] for i in range(0, rows, block)], dtype=torch.int32, device="cuda")
    batch = SlotBatch(slots, torch.arange(rows, device="cuda"), items, block, beside_matmuls=True)

    def step(lora: str | None):
        for _ in range(layers):
            for key, w, x, _, _, offsets in modules:
                if lora in ("beside", "beside + add"):
                    with batch.beside(x, key, w.shape[0]) as delta:
                        y = F.linear(x, w)
                    if lora == "beside + add":
                        y.add_(delta)
                else:
                    y = F.linear(x, w)
                    if lora == "in place":
                        batch.apply(x, y, key, offsets)

    times = {name: _graph_us(lambda: step(name)) for name in (None, "in place", "beside + add", "beside")}
    _row(kernel="lora_beside", rows=rows, layers=layers, base_us=times[None], in_place_us=times["in place"],
         beside_add_us=times["beside + add"], beside_us=times["beside"])


def _loras() -> None:
    for rows in (1, 4, 16):
        for outs, width in (([4096, 1024, 1024], 4096), ([4096], 4096), ([14336, 14336], 4096), ([4096], 14336)):
            _attempt(lora, rows, outs, width)


def _lora_launches() -> None:
    for adapters in (8, 64):
        for outs, width in (([4096, 1024, 1024], 4096), ([4096], 4096), ([14336, 14336], 4096), ([4096], 14336)):
            _attempt(lora_launch, 256, adapters, outs, width)


def _fp8s() -> None:
    for rows in (1, 4, 16, 32, 64, 128, 256, 1024):
        for outs, width in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            _attempt(fp8, rows, outs, width)


def _attempt(fn, *args) -> None:
    """One row; a failure is printed and the table goes on (one device call measures them all)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        print(f"FAILED {fn.__name__}{args!r:.120}: {type(e).__name__}: {e}", flush=True)


def _decodes() -> None:
    for shape, seqs, context in (("smollm2-135m", 1, 200), ("llama-3.1-8b", 1, 200), ("llama-3.1-8b", 1, 2000),
                                 ("llama-3.1-8b", 64, 256), ("llama-3.1-8b", 256, 256), ("llama-3.1-8b", 1024, 192),
                                 ("llama-3.1-8b", 200, 1500), ("llama-3.1-8b", 512, 1500)):
        _attempt(decode, shape, seqs, context, 32)


def _add_norms() -> None:
    for shape, tokens in (("smollm2-135m", 1), ("llama-3.1-8b", 1), ("llama-3.1-8b", 512), ("llama-3.1-8b", 8192)):
        _attempt(add_norm, shape, tokens)


def _prefills() -> None:
    if CudaKernels(torch.device("cuda"), torch.bfloat16).flash is None:
        print("varlen prefill: unsupported by this torch, not timed", flush=True)
        return
    for shape, chunks in (("llama-3.1-8b", [(128, 0)] * 64), ("llama-3.1-8b", [(1000, 0)] * 8),
                          ("llama-3.1-8b", [(96, 160), (128, 0), (500, 1000), (7, 33)]),
                          ("smollm2-135m", [(128, 0)] * 16)):
        _attempt(prefill, shape, chunks)


def _moes() -> None:
    for tokens in (1, 16, 64, 256, 1024, 4096):
        _attempt(moe, tokens)


def _lora_besides() -> None:
    for rows in (1, 16, 64):
        _attempt(lora_beside, rows)


SECTIONS = {"decode": _decodes, "add_norm": _add_norms, "prefill": _prefills, "moe": _moes, "fp8": _fp8s, "lora": _loras,
            "lora_beside": _lora_besides, "lora_launch": _lora_launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--only", choices=list(SECTIONS), action="append",
                        help="time these kernels only (repeatable); default all")
    args = parser.parse_args()
    try:
        from torch.nn.attention import varlen
        print("varlen_attn", inspect.signature(varlen.varlen_attn), flush=True)
    except ImportError:
        print("varlen_attn: not in this torch", flush=True)
    torch.manual_seed(0)
    for name in args.only or SECTIONS:
        SECTIONS[name]()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
