"""Mixtral's sparse mixture-of-experts feed-forward, in place of the dense MLP.

A router scores every expert per token; the top-k scores (softmax over all experts, then
renormalised over the k) weight the SwiGLU outputs of those k experts. All experts run in one
grouped GEMM per matmul over the tokens routed to them (torch._grouped_mm: CUTLASS on Hopper, a
loop over the groups elsewhere). Under tensor
parallelism each rank holds a slice of every expert's intermediate columns and the partial sums are
all-reduced once per layer, as the dense MLP's row linear does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.models.layers import Linear
from app.engine.parallel import TensorParallel


class SparseMoE(nn.Module):
    # HF expert tensor -> (our weight, rows of the intermediate it fills: 0 gate, 1 up)
    EXPERT_TENSORS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        self.top_k, self.tp = top_k, tp
        self.intermediate = intermediate_size // tp.size
        self.gate = Linear(hidden_size, num_experts, False, dtype)  # the router, whole on every rank
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate, dtype=dtype),
                               requires_grad=False)

    def load_expert(self, name: str, tensor: torch.Tensor, expert: int) -> None:
        """Copy one expert's HF tensor (w1 gate, w3 up, w2 down; whole): this rank keeps its slice."""
        target, half = self.EXPERT_TENSORS[name]
        if target == "w2":
            self.w2[expert].copy_(tensor.chunk(self.tp.size, dim=1)[self.tp.rank])
            return
        rows = tensor.chunk(self.tp.size, dim=0)[self.tp.rank]
        self.w13[expert, half * self.intermediate:(half + 1) * self.intermediate].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Adapters do not reach the experts (LlamaForCausalLM.lora_shapes).

        Every (token, chosen expert) pair becomes a row, rows are sorted by expert, and each of the two
        expert matmuls is one grouped GEMM over those segments: one launch for all experts, the
        segment ends computed on the device, so where the GEMM is native nothing waits for the host
        and decode steps can be captured in CUDA graphs."""
        t = x.shape[0]
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        order = experts.flatten().argsort(stable=True)  # row r of the sorted pairs is pair order[r]
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, experts.flatten(), torch.ones_like(order, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // self.top_k]
        gate, up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        h = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=ends)
        h = h * weights.flatten()[order, None].to(h.dtype)
        out = torch.empty_like(h).index_copy_(0, order, h)  # back to (token, choice) order: summed without atomics
        return self.tp.all_reduce(out.view(t, self.top_k, -1).sum(dim=1))
