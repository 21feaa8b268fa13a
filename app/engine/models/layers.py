"""Building blocks of the Llama family, written for a packed batch of tokens ([num_tokens, hidden]).

Linear layers fuse what runs side by side (q/k/v, gate/up) and load each HF tensor into its slice
through `load_shard`; that slice map is also where tensor-parallel sharding and per-slice LoRA
deltas attach.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.models.kernels import FP8, TorchKernels, fp8_linear, quantize_weight, with_delta
from app.engine.parallel import SINGLE, TensorParallel


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input, e.g. q, k, v.

    Under tensor parallelism a "column" linear keeps this rank's slice of every projection's
    outputs (no communication); a "row" linear keeps a slice of the inputs and all-reduces its
    partial outputs, so a column linear followed by a row linear costs one all-reduce.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE, parallel: str | None = None):
        super().__init__()
        self.tp, self.parallel = tp, parallel
        self.reduces = parallel == "row" and tp.size > 1  # partial sums over the TP group
        if parallel == "column":
            out_sizes = [size // tp.size for size in out_sizes]
        elif parallel == "row":
            in_features //= tp.size
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes), dtype=dtype), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None  # FP8 weights: [1, out] float32, one per output channel
        self.fp8_matmul = fp8_linear  # replaced by the device's FP8 kernel once loaded (finish_loading)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.lora_key: tuple[int, str] | None = None  # (layer, path): where adapters attach

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int) -> None:
        """Copy one HF tensor (whole, unsharded) into its place; this rank keeps its slice. An FP8
        weight's `weight_scale` (per tensor or per output channel) fills its slice of the per-channel
        scales: fused projections each keep their own scale, and nothing is requantized."""
        if name == "weight" and (tensor.dtype == FP8) != (self.weight.dtype == FP8):
            raise ValueError(f"a {tensor.dtype} weight for a linear held in {self.weight.dtype}: an FP8 weight "
                             "comes with its weight_scale, and projections fused into one linear are all FP8 or none")
        if name == "weight_scale":
            tensor = self._channel_scales(tensor, shard)
        if self.tp.size > 1 and self.parallel == "column":
            tensor = tensor.chunk(self.tp.size, dim=0)[self.tp.rank]
        elif self.tp.size > 1 and self.parallel == "row" and name == "weight":
            tensor = tensor.chunk(self.tp.size, dim=1)[self.tp.rank]
        start = sum(self.out_sizes[:shard])
        target = self.weight_scale[0] if name == "weight_scale" else getattr(self, name)
        target[start:start + self.out_sizes[shard]].copy_(tensor)

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """Copy an HF tensor that holds every projection already concatenated (Phi-3's qkv_proj)."""
        whole = [size * self.tp.size if self.parallel == "column" else size for size in self.out_sizes]
        per_tensor = name == "weight_scale" and tensor.numel() == 1  # one scale for every projection
        for shard, part in enumerate([tensor] * len(whole) if per_tensor else tensor.split(whole, dim=0)):
            self.load_shard(name, part, shard)

    def hold_fp8(self) -> None:
        """Hold an FP8 checkpoint's weight as it is stored: E4M3, with [1, out] float32 scales. Both
        start NaN, so the loader finds what no checkpoint tensor filled."""
        if self.weight.dtype == FP8:  # q, k and v each ask
            return
        nan, device = float("nan"), self.weight.device
        self.weight = nn.Parameter(torch.full_like(self.weight, nan, dtype=FP8), requires_grad=False)
        scale = torch.full((1, self.weight.shape[0]), nan, dtype=torch.float32, device=device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def _channel_scales(self, scale: torch.Tensor, shard: int) -> torch.Tensor:
        """Projection `shard`'s scales, one per output channel of the whole (unsharded) projection."""
        outputs = self.out_sizes[shard] * (self.tp.size if self.parallel == "column" else 1)
        if scale.numel() == 1:  # per tensor (ModelOpt FP8: shape []; compressed-tensors "tensor": [1])
            return scale.reshape(1).expand(outputs)
        if scale.shape[0] == outputs and scale.numel() == outputs:  # per channel: [out] or [out, 1]
            return scale.reshape(outputs)
        raise ValueError(f"a weight_scale of shape {list(scale.shape)} for {outputs} output channels: FP8 weights "
                         "load with per-tensor or per-channel scales, not block-wise ones")

    def quantize_fp8(self) -> None:
        """The weight in FP8 (E4M3) with one scale per output channel, computed on this rank's slice;
        the 16-bit weight is dropped. It multiplies op by op (fp8_linear) until given the device's
        FP8 kernel (`fp8_matmul`, set by LlamaForCausalLM.finish_loading)."""
        weight, scale = quantize_weight(self.weight)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def pack_for_cpu(self) -> None:
        """Reorder the weight into oneDNN's blocked layout once (where TorchKernels.packs_linears)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 64)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        y = self._matmul(x)
        if lora is not None:  # before the reduce: a row linear's adapter input is sliced too
            y = lora.apply(x, y, self.lora_key, self.offsets)
        if self.reduces:
            y = self.tp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    def forward_split(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, its LoRA delta still to add, or None). Where `lora` runs adapters beside the matmul (in
        a CUDA graph, SlotBatch.beside), the delta comes back apart, float32, for the kernel that reads
        y next to add (kernels.py, `delta`): the adapter's kernels then overlap the matmul and its add
        costs no launch of its own. Otherwise y holds everything, as forward returns it."""
        if lora is None or self.reduces or not lora.runs_beside(self.lora_key):
            return self.forward(x, lora), None
        with lora.beside(x, self.lora_key, self.weight.shape[0]) as delta:
            y = self._matmul(x)
        return y, delta

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        # A row linear's bias is added once, after the partial sums are reduced.
        bias = None if self.reduces else self.bias
        if self.weight_scale is not None:
            return self.fp8_matmul(x, self.weight, self.weight_scale, bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class Linear(MergedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE, parallel: str | None = None):
        super().__init__(in_features, [out_features], bias, dtype, tp, parallel)


class RMSNorm(nn.Module):
    """unit_offset (Gemma): checkpoints hold w and the norm scales by 1 + w, in float32 and rounded once
    (transformers' Gemma2RMSNorm). The weight holds 1 + w in float32, added once at load, so 1 + w is
    never rounded to 16 bits, and the norm runs in float32 for it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, kernels: TorchKernels, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset, self.kernels = eps, unit_offset, kernels
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32 if unit_offset else dtype),
                                   requires_grad=False)

    def load(self, tensor: torch.Tensor) -> None:
        self.weight.copy_(tensor.float() + 1.0 if self.unit_offset else tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, delta: torch.Tensor | None = None):
        """RMSNorm(x); or, given the residual stream, adds x to it in place and returns
        (RMSNorm(residual), residual). delta: x's pending LoRA delta (MergedLinear.forward_split)."""
        if residual is None:
            return self.kernels.rms_norm(with_delta(x, delta), self.weight, self.eps, self.unit_offset)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset, delta), residual


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table computed once for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind != "default":
            raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's tokens, [T, 1, D]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
