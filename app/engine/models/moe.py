"""Mixtral's sparse mixture-of-experts feed-forward, in place of the dense MLP.

A router scores every expert per token; the top-k scores (softmax over all experts, then
renormalised over the k) weight the SwiGLU outputs of those k experts. Experts run one by one
over the tokens routed to them, so a step's cost follows the experts it hits. Under tensor
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

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """`lora` is accepted for the dense MLP's signature: adapters do not reach the experts."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return self.tp.all_reduce(out)
