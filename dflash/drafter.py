"""The DFlash drafter: Qwen3-style layers over blocks of [anchor, MASK x (B-1)], conditioned on the
target's hidden states by KV injection. Pure module: no data handling, no loss.

    ctx    = hidden_norm(fc(concat of the L captured target layers))            # [T, H]
    block  = target_embed([anchor token, MASK, ..., MASK])                       # [A*B, H]
    layer: Q from the block; K, V = this layer's k_proj / v_proj of [ctx ; block]; RoPE on Q and K;
           attention is not causal inside a block; a block sees only the context before its anchor.
    logits = target_lm_head(norm(h))

The embeddings and the LM head are the target's, frozen (buffers: never trained, never saved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of the drafter. `hidden_size` and `vocab_size` are the target's (it borrows them)."""

    num_layers: int = 5
    """Decoder layers of the drafter."""
    hidden_size: int = 4096
    """Must equal the target's hidden size."""
    intermediate_size: int = 12288
    """SwiGLU MLP width."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 8
    """Key/value heads (GQA)."""
    head_dim: int = 128
    """Width of one head."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base (Qwen3: 1e6)."""
    block_size: int = 16
    """B: tokens per draft block (the anchor and B-1 MASK tokens)."""
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 9, 17, 25, 33])
    """Target layers the drafter reads (a subset of the cache's); their count sets fc's input width."""
    mask_token_id: int = 0
    """The MASK token: a token id in the target's vocabulary."""
    vocab_size: int = 151936
    """The target's vocabulary size."""
    max_position_embeddings: int = 40960
    """Recorded in the export's config.json; RoPE itself needs no table."""

    def to_dict(self) -> dict:
        return asdict(self)

    # -- the Hugging Face schema: the one place that maps the drafter to and from config.json ------------

    @classmethod
    def from_hf(cls, hf: dict) -> DrafterConfig:
        """The drafter of an exported config.json (`to_hf`'s). Keys that some configs leave out fall back
        to Qwen3's choices: head_dim = hidden / heads, RoPE base 1e6 (transformers 5 keeps it in
        `rope_parameters`), 40960 positions, the target's key/value heads, a 3 x hidden MLP."""
        heads = hf["num_attention_heads"]
        dflash = hf.get("dflash_config") or {}
        return cls(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf.get("intermediate_size") or 3 * hf["hidden_size"],
                   num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                   rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                   rope_theta=(hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta") or 1e6,
                   block_size=hf["block_size"], target_layer_ids=list(dflash["target_layer_ids"]),
                   mask_token_id=int(dflash["mask_token_id"]), vocab_size=hf["vocab_size"],
                   max_position_embeddings=hf.get("max_position_embeddings", 40960))

    @classmethod
    def from_target_config(cls, target: dict, *, hidden_size: int, vocab_size: int, num_layers: int,
                           block_size: int, target_layer_ids: list[int], mask_token_id: int,
                           **widths: int | float | None) -> DrafterConfig:
        """A drafter for the target of this Hugging Face config.json (its text config, for a multimodal one).
        `widths` (intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rope_theta) left at
        None are the target's, read as `from_hf` reads a drafter's: the drafter is a Qwen3-style model too.
        An MoE target without a dense MLP width gets 3 x hidden, the dense Qwen3 ratio."""
        target = target.get("text_config", target)
        hf = {**target, **{k: v for k, v in widths.items() if v is not None},
              "num_hidden_layers": num_layers, "hidden_size": hidden_size, "vocab_size": vocab_size,
              "block_size": block_size,
              "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}}
        if widths.get("rope_theta"):
            hf["rope_parameters"] = {**(target.get("rope_parameters") or {}), "rope_theta": widths["rope_theta"]}
        return cls.from_hf(hf)

    def to_hf(self, num_target_layers: int) -> dict:
        """The config.json of the reference export (what SGLang and vLLM read)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "block_size": self.block_size,
            "num_target_layers": num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "layer_types": ["full_attention"] * self.num_layers,
        }


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face / Qwen convention). x: [..., N, D]; cos, sin: [N, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] (fp32) for integer positions [N]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_q * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_q * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of states x [n, H] at positions with RoPE tables cos, sin:
        ([n_kv, n, D], [n_kv, n, D]). Per token, so context keys can be computed once and cached."""
        n, D = x.shape[0], self.head_dim
        k = self.k_norm(self.k_proj(x).view(n, self.n_kv, D)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.n_kv, D).transpose(0, 1)
        return rope(k, cos, sin).to(x.dtype), v

    def forward(self, x: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], rope_q, attend) -> torch.Tensor:
        """x: block states [N, H]; ctx_kv: this layer's keys/values of the context (KV injection);
        rope_q: tables for the N block positions; attend(q, k, v) -> [1, n_q, N, D] over [ctx ; block]."""
        N, D = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(N, self.n_q, D)).transpose(0, 1)  # [n_q, N, D]
        q = rope(q, *rope_q).to(x.dtype)
        k_blk, v_blk = self.kv(x, *rope_q)
        k = torch.cat([ctx_kv[0], k_blk], dim=1)  # [n_kv, T+N, D]
        v = torch.cat([ctx_kv[1], v_blk], dim=1)
        out = attend(q[None], k[None], v[None])  # [1, n_q, N, D]
        return self.o_proj(out[0].transpose(0, 1).reshape(N, self.n_q * D))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx_kv, rope_q, attend):
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, rope_q, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """Parameters are those of the reference export (`layers.{i}...`, `fc`, `hidden_norm`, `norm`)."""

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        # the target's, frozen: buffers so that optimizers, state_dict and DDP leave them alone
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)  # `cache_rope`'s tables [P, head_dim]
        self.register_buffer("rope_sin", None, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def cache_rope(self, positions: int) -> None:
        """Keep the RoPE tables of positions 0 .. positions-1 for a compiled step to read (`rope`)."""
        self.rope_cos, self.rope_sin = rope_tables(torch.arange(positions, device=self.fc.weight.device),
                                                   self.cfg.head_dim, self.cfg.rope_theta)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] of positions [n]. A compiled step reads them from `cache_rope`'s tables
        (its positions must be below their size): computed in the graph, Inductor recomputes sin and cos
        in every kernel that applies RoPE, and those kernels take seconds each to compile."""
        if self.rope_cos is not None and torch.compiler.is_compiling():
            return self.rope_cos[positions], self.rope_sin[positions]
        return rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, L, H] captured target states -> [T, H] context features."""
        x = hidden.reshape(hidden.shape[0], -1)  # [T, L*H]
        if not torch.is_autocast_enabled(x.device.type):  # under autocast the bf16 states feed fc as they are
            x = x.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight)

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values of context features ctx [T, H] at positions ctx_pos [T]."""
        rope_ctx = self.rope(ctx_pos)
        return [layer.self_attn.kv(ctx, *rope_ctx) for layer in self.layers]

    def forward(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, block_ids: torch.Tensor, block_pos: torch.Tensor,
                attend, ctx_kv: list | None = None) -> torch.Tensor:
        """Final normed states of the block tokens [N, H].

        ctx [T, H] and ctx_pos [T]: context features and their positions (or their per-layer keys and
        values, `ctx_kv`, as `context_kv` makes them: what decoding caches); block_ids, block_pos [N]:
        the block tokens (anchor, MASK, ...) and their positions; attend(q, k, v): attention with the
        mask that says which of the T + N keys each of the N queries sees."""
        if ctx_kv is None:
            ctx_kv = self.context_kv(ctx, ctx_pos)
        x = self.embed(block_ids).to(ctx_kv[0][0].dtype)  # [N, H]
        rope_q = self.rope(block_pos)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, rope_q, attend)
        return self.norm(x)
