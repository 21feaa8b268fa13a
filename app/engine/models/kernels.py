"""The kernels a model's layers run, chosen once when the model is built (`select_kernels`). The
layers call the object they were given and never ask which device they are on.

- `TorchKernels`, anywhere: torch ops as transformers computes them, attention through SDPA
  (app/engine/models/attention.py); on CPU in float32 the linear weights are packed for oneDNN.
- `CudaKernels`: Triton kernels for decode attention (paged, CUDA-graph safe), the rotary
  embedding fused with the cache write, SiLU * up, the residual add fused with RMSNorm, and FP8
  linears (triton_fp8.py); in 16-bit a step's prefill chunks go through one varlen flash-attention call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.models.attention import (FP8, FP8_MAX, AttentionMetadata, decode_attention, flash_varlen,
                                         prefill_attention, store_kv)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (weight / scale in FP8 [N, K], scale [1, N] float32): one scale per output
    channel, the channel's amax / 448."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight / scale).to(FP8), scale.t().contiguous()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T with both in FP8: x quantized on the fly, one scale per token (dynamic, so an
    outlier token costs only its own precision), then one scaled matmul that writes x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    y = torch._scaled_mm((rows.float() / scale).to(FP8), weight.t(), scale_a=scale, scale_b=weight_scale,
                         out_dtype=x.dtype)
    if bias is not None:  # added here: _scaled_mm takes no bias with a float32 output
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


class TorchKernels:
    fp8_linear = staticmethod(fp8_linear)

    def __init__(self, device: torch.device, dtype: torch.dtype):
        # oneDNN's blocked weight layout: on the 2-core dev CPU it halves small-batch matmul time.
        self.packs_linears = (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
                              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        # torch._grouped_mm (experts) as one kernel reading its segment ends on the device: without
        # it the groups are looped over from the host, which a CUDA graph cannot capture.
        self.grouped_gemm_on_device = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, in_float32: bool) -> torch.Tensor:
        """in_float32 (Gemma): normalise and scale in float32, round once."""
        if in_float32:
            return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
        if x.dtype == torch.float32:  # one fused op, the same arithmetic as below
            return F.rms_norm(x, weight.shape, weight, eps)
        # In float32 and cast back before the weight, exactly as transformers' LlamaRMSNorm.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    # `delta` (add_rms_norm, silu_mul, rotary_store): the LoRA delta of the projection whose output
    # they read, float32, where a CUDA graph computed it beside the matmul (lora.SlotBatch.beside);
    # added to that output first, rounded as `output.add_(delta)` would.

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     in_float32: bool, delta: torch.Tensor | None = None) -> torch.Tensor:
        """residual += x, in place; returns the norm of the sum."""
        return self.rms_norm(residual.add_(with_delta(x, delta)), weight, eps, in_float32)

    def silu_mul(self, gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rotary_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, delta: torch.Tensor | None = None):
        """Split qkv [T, (H + 2 KVH) * D] into q [T, H, D], k, v [T, KVH, D], rotate q and k (cos, sin:
        [T, 1, D]) and write k and v into their cache slots. k and v come back as the cache holds them
        (an FP8 cache: divided by kv_scales' key and value scale, rounded, multiplied back)."""
        qkv = with_delta(qkv, delta)
        t, head_dim = qkv.shape[0], k_cache.shape[-1]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k = _rotate(q.view(t, num_heads, head_dim), cos, sin), _rotate(k.view(t, num_kv_heads, head_dim), cos, sin)
        k, v = store_kv(k, v.view(t, num_kv_heads, head_dim), k_cache, v_cache, slots, kv_scales)
        return q, k, v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                  softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D], already in the caches [num_blocks, block_size, KVH, D].
        window: keys each query sees, itself included (None: all before it); softcap: tanh(s / cap) * cap
        on the scaled logits; kv_scales: an FP8 cache's key and value scales. Returns [T, H, D], in `out`
        where one is given (a step's decode rows are written there directly)."""
        nd, prefills = meta.num_decodes, meta.prefills is not None
        if out is None and (not nd or not prefills):  # one part: its own result, no copy
            if nd:
                return self._decode(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
        out = torch.empty_like(q) if out is None else out
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, kv_scales, out[:nd])
        if prefills:
            out[nd:].copy_(self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale, window, softcap,
                                         kv_scales))
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, window, softcap, kv_scales, out=None):
        result = decode_attention(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
        return result if out is None else out.copy_(result)

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales):
        return prefill_attention(q, k, v, k_cache, v_cache, meta.prefills, scale, window, softcap, kv_scales)


class CudaKernels(TorchKernels):
    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__(device, dtype)
        self.grouped_gemm_on_device = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
        self.flash = flash_varlen() if dtype in (torch.bfloat16, torch.float16) else None
        # Imported here: Triton compiles for a GPU, and a CPU-only install may lack it.
        from app.engine.models import triton_attention, triton_fp8, triton_fused
        self.triton_attention, self.triton_fused = triton_attention, triton_fused
        self.fp8_linear = triton_fp8.fp8_linear

    def rms_norm(self, x, weight, eps, in_float32):
        if in_float32:
            return super().rms_norm(x, weight, eps, in_float32)
        # One kernel; in 16-bit it rounds once instead of before the weight (within bf16 tolerance),
        # for a fraction of the seven kernels of the unfused norm, which bound a small decode step.
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps, in_float32, delta=None):
        # float32 inside, one rounding: with a float32 weight (Gemma's 1 + w) that is Gemma's norm too.
        return self.triton_fused.add_rms_norm(x, residual, weight, eps, delta)

    def silu_mul(self, gate_up, delta=None):
        return self.triton_fused.silu_mul(gate_up, delta)

    def rotary_store(self, qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots, kv_scales=None,
                     delta=None):
        half = k_cache.shape[-1] // 2
        fused = self.triton_fused if not half & (half - 1) else super()  # the fused kernel's tile is a power of 2
        return fused.rotary_store(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots, kv_scales, delta)

    def _decode(self, q, k_cache, v_cache, meta, scale, window, softcap, kv_scales, out=None):
        return self.triton_attention.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, scale, window, softcap, kv_scales,
                                                  out=out)

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales):
        if self.flash is None or softcap is not None or (window is not None and not self.flash.windowed):
            return super()._prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
        p = meta.prefills
        k, v = p.keys(k, v, k_cache, v_cache, kv_scales)
        return self.flash(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, scale, window)


def select_kernels(device: torch.device, dtype: torch.dtype) -> TorchKernels:
    return CudaKernels(device, dtype) if device.type == "cuda" else TorchKernels(device, dtype)


def with_delta(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """x += a LoRA delta (float32), in place, one rounding to x's dtype; x itself where there is none."""
    return x if delta is None else x.add_(delta)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
