"""Llama-family decoder (Llama 2/3, Mistral, Mixtral, Phi-3, Qwen2, Qwen3, Gemma 2, SmolLM2, TinyLlama) over a
paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.models.attention import AttentionMetadata
from app.engine.models.kernels import TorchKernels, with_delta
from app.engine.models.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding
from app.engine.models.moe import SparseMoE
from app.engine.parallel import SINGLE, ParallelLayout, TensorParallel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "gemma2")


@dataclass
class ModelConfig:
    """The architecture fields we use from an HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each query and key head, before the rotation
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window (keys seen, own included), or None
    num_experts: int = 0  # Mixtral: a sparse mixture of experts in place of the MLP
    experts_per_token: int = 0
    # Gemma 2:
    hidden_act: str = "silu"  # gelu_pytorch_tanh: GELU's tanh approximation
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (default: head_dim's)
    attn_logit_softcapping: float | None = None  # tanh(s / cap) * cap on the attention logits
    final_logit_softcapping: float | None = None  # the same on the output logits
    gemma_norms: bool = False  # norms scale by 1 + w; norms after attention and MLP too; embeddings * sqrt(hidden)

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (the whole head is rotated)")
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = d["num_attention_heads"]
        gemma = model_type == "gemma2"
        return cls(
            model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            qkv_bias=d.get("attention_bias", model_type == "qwen2"), qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(model_type, d),
            num_experts=d.get("num_local_experts", 0) if model_type == "mixtral" else 0,
            experts_per_token=d.get("num_experts_per_tok", 0),
            hidden_act=act,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=d.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
            gemma_norms=gemma,
        )

    @property
    def max_seq_len(self) -> int:
        return self.max_position_embeddings


def _layer_windows(model_type: str, d: dict) -> tuple[int | None, ...]:
    """Which layers slide, as transformers' modeling code of each family decides."""
    n, window = d["num_hidden_layers"], d.get("sliding_window")
    if model_type in ("mistral", "mixtral", "phi3"):  # every layer, whatever layer_types says
        return (window,) * n
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return (None,) * n
    types = d.get("layer_types")
    if types is None and model_type == "gemma2":  # configs without layer_types: the config classes' defaults
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif types is None and model_type in ("qwen2", "qwen3"):
        types = ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention" for i in range(n)]
    return tuple(window if kind == "sliding_attention" else None for kind in types or [None] * n)


class Attention(nn.Module):
    """Under tensor parallelism each rank holds num_heads / tp query heads and their KV heads."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, tp: TensorParallel, kernels: TorchKernels):
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias, dtype, tp, "column")
        self.o_proj = Linear(q_size, cfg.hidden_size, False, dtype, tp, "row")
        self.split = (q_size // tp.size, kv_size // tp.size, kv_size // tp.size)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window, self.softcap = cfg.layer_windows[layer], cfg.attn_logit_softcapping
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        # An FP8 KV cache holds k / k_scale and v / v_scale (read only then). 1.0, as vLLM and TensorRT-LLM
        # take without calibrated scales: a checkpoint's are not read yet (UNREAD), a loader of them fills these.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata, lora):
        """(the attention block's output, o_proj's pending LoRA delta or None: MergedLinear.forward_split)"""
        t = x.shape[0]
        qkv, delta = self.qkv_proj.forward_split(x, lora) if self.q_norm is None else (self.qkv_proj(x, lora), None)
        if self.q_norm is not None:  # in place, so the rotation below takes the normed heads
            q_size, kv_size = self.split[0], self.split[1]
            q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        scales = (self.k_scale, self.v_scale)
        q, k, v = self.kernels.rotary_store(qkv, self.num_heads, self.num_kv_heads, *rope, kv_cache[0], kv_cache[1],
                                            meta.slot_mapping, scales, delta)
        o = self.kernels.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap,
                                   scales)
        return self.o_proj.forward_split(o.view(t, -1), lora)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, kernels: TorchKernels):
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype, tp, "column")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, tp, "row")
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x, lora):
        """(the MLP's output, down_proj's pending LoRA delta or None: MergedLinear.forward_split)"""
        if self.gelu:
            gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh").mul_(up)
        else:
            h = self.kernels.silu_mul(*self.gate_up_proj.forward_split(x, lora))
        return self.down_proj.forward_split(h, lora)


class DecoderLayer(nn.Module):
    """Gemma 2 norms each sublayer's output too: post_attention_layernorm is then a plain norm of the
    attention output, and pre_feedforward_layernorm takes the residual add before the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, tp: TensorParallel, kernels: TorchKernels):
        super().__init__()
        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels, unit_offset=cfg.gemma_norms)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, dtype, tp, kernels)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if cfg.gemma_norms else None
        self.post_feedforward_layernorm = norm() if cfg.gemma_norms else None
        self.mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token, dtype, tp) \
            if cfg.num_experts else MLP(cfg, dtype, tp, kernels)

    def forward(self, x, x_delta, residual, rope, kv_cache, meta, lora):
        """x: the previous layer's MLP output (x_delta: its pending LoRA delta, or None), added here to
        the residual stream (None before the first layer, whose x is the stream itself). Returns this
        layer's MLP output, its pending delta and the stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual, x_delta)
        h, delta = self.self_attn(h, rope, kv_cache, meta, lora)
        if self.pre_feedforward_layernorm is not None:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h, delta=delta), residual)
            out, delta = self._mlp(h, lora)
            return self.post_feedforward_layernorm(out, delta=delta), None, residual
        h, residual = self.post_attention_layernorm(h, residual, delta)
        return *self._mlp(h, lora), residual

    def _mlp(self, h, lora):
        """(output, pending LoRA delta): adapters do not reach a mixture of experts."""
        return self.mlp(h, lora) if isinstance(self.mlp, MLP) else (self.mlp(h), None)


class LlamaForCausalLM(nn.Module):
    """The whole model, or one rank's part of it: a pipeline stage holds its own decoder layers
    (the first stage the embedding, the last the final norm and lm_head), and under tensor
    parallelism each layer holds its slice of heads and MLP columns."""

    # HF projection -> (our module within a decoder layer, shard of its merged linear). The one table
    # the checkpoint loader (hf_target), the adapter loader and the LoRA shapes read. A checkpoint
    # that already fuses them (Phi-3's qkv_proj, gate_up_proj) names the merged linear: shard None.
    PROJECTIONS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
                   "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
                   "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
                   "down_proj": ("mlp.down_proj", 0)}
    FUSED = ("qkv_proj", "gate_up_proj")
    # Checkpoint tensors nothing reads. FP8 KV-cache scales (ModelOpt: k_proj.k_scale, v_proj.v_scale;
    # compressed-tensors: self_attn.k_scale, v_scale, or k_proj/v_proj.output_scale): a checkpoint's
    # KV-cache quantization is not applied. Static activation scales (input_scale): FP8 linears scale
    # each token's activations on the fly, which never clips and fits each token at least as well.
    UNREAD = (".k_scale", ".v_scale", ".kv_scale", "k_proj.output_scale", "v_proj.output_scale", ".input_scale")

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, kernels: TorchKernels,
                 layout: ParallelLayout = ParallelLayout(), tp: TensorParallel = SINGLE):
        super().__init__()
        layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.num_layers)
        self.config, self.kernels = cfg, kernels
        self.is_first, self.is_last = layout.is_first_stage, layout.is_last_stage
        self.layer_ids = layout.stage_layers(cfg.num_layers)  # global indices of this stage's layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.embed_tokens.weight.requires_grad_(False)
        # Gemma scales embeddings by sqrt(hidden) rounded to the model's dtype, as transformers does.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(dtype)
                             if cfg.gemma_norms and self.is_first else None, persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, index, dtype, tp, kernels) for index in self.layer_ids)
        for index, layer in zip(self.layer_ids, self.layers):
            for path, module in layer.named_modules():
                if isinstance(module, MergedLinear):
                    module.lora_key = (index, path)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels, unit_offset=cfg.gemma_norms)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
            if cfg.tie_word_embeddings and self.is_first:
                self.lm_head.weight = self.embed_tokens.weight

    def hold_fp8(self, scale_names: list[str]) -> None:
        """Before an FP8 checkpoint's tensors load: FP8 storage for each linear whose weight comes
        with one of `scale_names` (its `*.weight_scale` tensors)."""
        for name in scale_names:
            target = self.hf_target(name)
            if target is None:
                continue
            if not isinstance(target[0], MergedLinear):
                raise ValueError(f"checkpoint tensor {name!r}: FP8 weights load into linear layers, not into "
                                 f"{type(target[0]).__name__} (FP8 mixture-of-experts weights are not supported)")
            target[0].hold_fp8()

    def finish_loading(self, quantization: str | None = None) -> None:
        """Weights are in place: quantize the decoder layers' 16-bit linears where asked (`fp8`; the
        lm_head and embeddings keep the model's dtype, and an FP8 checkpoint's linears are FP8
        already), then prepare the kernels' layouts."""
        if quantization == "fp8":
            for module in self.layers.modules():
                if isinstance(module, MergedLinear) and module.weight_scale is None:
                    module.quantize_fp8()
        fp8_linears = [m for m in self.modules() if isinstance(m, MergedLinear) and m.weight_scale is not None]
        for module in fp8_linears:
            module.fp8_matmul = self.kernels.fp8_linear
        # The 16-bit weights that FP8 ones replaced (quantized, or held for an FP8 checkpoint): their
        # memory back, before the KV pool is sized from what is free.
        if fp8_linears and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.kernels.packs_linears:
            for module in self.modules():
                if isinstance(module, MergedLinear) and module.weight_scale is None:
                    module.pack_for_cpu()

    def graph_capturable(self) -> bool:
        """Whether a decode step runs without the host, as a CUDA graph needs."""
        return not self.config.num_experts or self.kernels.grouped_gemm_on_device

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices, lora=None,
                hidden=None):
        """Logits for the rows in logits_indices (last stage), else the hidden states for the next
        stage, which arrive as `hidden` there. `lora` (a LoRABatch) adapts the rows it names."""
        x, residual = self.trunk(input_ids, positions, kv_caches, meta, lora, hidden)
        if not self.is_last:
            return x + residual  # the next stage starts from the whole stream
        return self.head(x, residual, logits_indices)

    def trunk(self, input_ids, positions, kv_caches, meta: AttentionMetadata, lora=None, hidden=None):
        """Every row through this stage's layers: (the last layer's MLP output, the residual stream)."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if hidden is None and self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rotary.table(positions, x.dtype)
        residual = delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta, residual = layer(x, delta, residual, rope, kv_cache, meta, lora)
        return with_delta(x, delta), residual

    def head(self, x, residual, logits_indices):
        """Float32 logits of the rows in logits_indices (last stage)."""
        h, _ = self.norm(x[logits_indices], residual[logits_indices])
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def hf_target(self, name: str):
        """(module, parameter name, shard) that HF checkpoint tensor `name` loads into, or None for
        names this rank does not hold (another stage's layers, rotary buffers, a tied head, UNREAD scales)."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or name.endswith(self.UNREAD):
            return None
        if name == "embed_tokens.weight" and self.is_last and not self.is_first and self.config.tie_word_embeddings:
            name = "lm_head.weight"  # a last stage without the embedding still needs its tied head
        elif name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return None
        parts = name.split(".")
        if parts[0] == "layers":
            index = int(parts[1])
            if index not in self.layer_ids:
                return None
            parts[1] = str(index - self.layer_ids.start)
        elif not hasattr(self, parts[0]):  # embedding, norm or head of another stage
            return None
        if len(parts) > 3 and parts[2] == "block_sparse_moe":  # Mixtral: layers.i.block_sparse_moe.{gate,experts.e.w1}
            parts[2] = "mlp"
            if parts[3] == "experts":
                return self.get_submodule(".".join(parts[:3])), parts[5], int(parts[4])
        shard = 0
        if len(parts) >= 4 and parts[-2] in self.PROJECTIONS:
            path, shard = self.PROJECTIONS[parts[-2]]
            parts[-3:-1] = path.split(".")
        elif len(parts) >= 4 and parts[-2] in self.FUSED:
            shard = None
        return self.get_submodule(".".join(parts[:-1])), parts[-1], shard

    @staticmethod
    def lora_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """HF projection -> full (unsharded) (in, out), for each projection an adapter may reach (a
        mixture of experts has no dense MLP)."""
        q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
            cfg.intermediate_size
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
        if not cfg.num_experts:
            shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
        return shapes

    def load_hf_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one HF checkpoint tensor (unsharded) into place; False for names this rank does not hold."""
        target = self.hf_target(name)
        if target is None:
            return False
        module, param, shard = target
        if isinstance(module, SparseMoE):
            module.load_expert(param, tensor, shard)
        elif isinstance(module, RMSNorm):
            module.load(tensor)
        elif isinstance(module, MergedLinear) and shard is None:
            module.load_fused(param, tensor)
        elif isinstance(module, MergedLinear):
            module.load_shard(param, tensor, shard)
        else:
            getattr(module, param).copy_(tensor)
        return True
