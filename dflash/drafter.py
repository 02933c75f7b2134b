"""The DFlash drafter: Qwen3-style layers over blocks of [anchor, MASK x (B-1)], conditioned on the
target's hidden states by KV injection. Pure module: no data handling, no loss.

    ctx    = hidden_norm(fc(concat of the L captured target layers))            # [T, H]
    block  = target_embed([anchor token, MASK, ..., MASK])                       # [A*B, H]
    layer: Q from the block; K, V = this layer's k_proj / v_proj of [ctx ; block]; RoPE on Q and K;
           attention is not causal inside a block; a block sees only the context before its anchor.
    logits = target_lm_head(norm(h))

The embeddings and the LM head are the target's, frozen (buffers: never trained, never saved).

`Drafter` is also the interface every architecture implements (`architectures()`, the one place one is chosen by
`DrafterConfig.arch`): its layers (`layer_class`), its loss terms beside the unary cross-entropy (`extra_loss`),
its greedy draft from the final states (`propose`) and what its export says (`architecture`, `export_keys`,
`format_refusal`). DFlash2 (`dflash.dflash2`) overrides them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import DrafterConfig


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


def recomputed(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), keeping only x for the backward, which runs fn again (torch.utils.checkpoint: traced into a compiled
    graph, where the partitioner recomputes what the backward needs). fn holds no randomness to replay."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)


RECOMPUTE = ("none", "mlp", "attention", "layers")  # what `Drafter.forward` may recompute in the backward


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention(self, y, ctx_kv, rope_q, attend) -> torch.Tensor:
        """The attention sublayer's output for residual states y [N, H] (before the residual add)."""
        return self.self_attn(self.input_layernorm(y), ctx_kv, rope_q, attend)

    def feed_forward(self, y) -> torch.Tensor:
        """The MLP sublayer's output for residual states y [N, H] (before the residual add)."""
        return self.mlp(self.post_attention_layernorm(y))

    def forward(self, x, ctx_kv, rope_q, attend, recompute: str = "none"):
        """`recompute` (`mlp`, `attention`): that sublayer (with its norm) keeps only its input for the backward."""
        def attention(y):
            return self.attention(y, ctx_kv, rope_q, attend)

        x = x + (recomputed(attention, x) if recompute == "attention" else attention(x))
        return x + (recomputed(self.feed_forward, x) if recompute == "mlp" else self.feed_forward(x))


class Drafter(nn.Module):
    """Parameters are those of the reference export (`layers.{i}...`, `fc`, `hidden_norm`, `norm`)."""

    layer_class = Layer
    architecture = "DFlashDraftModel"  # the export's `architectures`: what the servers pick their model by
    export_keys: tuple[str, ...] = ()  # DrafterConfig fields an export writes into dflash_config (and reads back)
    candidates = 0  # top-K unary candidates of each slot the objective hands to `extra_loss` (0: none)
    # a zlab export writes `is_causal` always (True), or only where the layer types alone would mislead (DFlash)
    explicit_causality = False

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        if cfg.unresolved():
            raise ValueError(f"DrafterConfig fields {cfg.unresolved()} are unresolved: see config.resolve_drafter")
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.add_modules(cfg)
        # the target's, frozen: buffers so that optimizers, state_dict and DDP leave them alone
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)  # `cache_rope`'s tables [P, head_dim]
        self.register_buffer("rope_sin", None, persistent=False)
        self.reset_parameters()

    def add_modules(self, cfg: DrafterConfig) -> None:
        """Modules an architecture adds beside the layers, before the parameters are initialised (DFlash: none)."""

    def own_parameters(self) -> set[str]:
        """Parameters an architecture initialises itself, after the others (DFlash: none)."""
        return set()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int = 0) -> torch.Generator:
        """Norms 1, every other weight normal(0, std), drawn in parameter order from `seed` (`own_parameters`
        skipped: the same seed gives every architecture the same backbone). Returns the generator, for them."""
        g = torch.Generator().manual_seed(seed)
        own = self.own_parameters()
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name not in own:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        return g

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
                attend, ctx_kv: list | None = None, recompute: str = "none") -> torch.Tensor:
        """Final normed states of the block tokens [N, H].

        ctx [T, H] and ctx_pos [T]: context features and their positions (or their per-layer keys and
        values, `ctx_kv`, as `context_kv` makes them: what decoding caches); block_ids, block_pos [N]:
        the block tokens (anchor, MASK, ...) and their positions; attend(q, k, v): attention with the
        mask that says which of the T + N keys each of the N queries sees. `recompute` (one of RECOMPUTE, while
        gradients are recorded): what of each layer the backward recomputes instead of keeping (the same result)."""
        if ctx_kv is None:
            ctx_kv = self.context_kv(ctx, ctx_pos)
        x = self.embed(block_ids).to(ctx_kv[0][0].dtype)  # [N, H]
        rope_q = self.rope(block_pos)
        if not torch.is_grad_enabled():
            recompute = "none"
        for layer, kv in zip(self.layers, ctx_kv):
            if recompute == "layers":
                x = recomputed(lambda y, layer=layer, kv=kv: layer(y, kv, rope_q, attend), x)
            else:
                x = layer(x, kv, rope_q, attend, recompute)
        return self.norm(x)

    # -- what an architecture adds: its own loss terms, its greedy draft, its export -------------------------

    def extra_loss(self, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, candidates, prev: torch.Tensor,
                   alpha: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Loss terms beside the unary cross-entropy, for the rows h [R, H] (slots 1..B-1 of A blocks) with labels
        [R], constant row weights [R], the unary logits' top-K `candidates` (values, indices [R, K]) and the data's
        token before each slot, prev [A, B-1]: (their weighted sum, the greedy drafts [A, B-1]), or None (DFlash:
        nothing more; its drafts are the unary argmax)."""
        return None

    def head_chunks(self, h: torch.Tensor, chunk: int = 1024):
        """The frozen head's logits of states h [..., H], `chunk` rows at a time ([rows, V] never at once)."""
        rows = h.reshape(-1, h.shape[-1]).to(self.head_weight.dtype)
        for i in range(0, rows.shape[0], chunk):
            yield rows[i : i + chunk] @ self.head_weight.t()

    def propose(self, h: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy drafts [n, B-1] of blocks whose slots 1..B-1 have final states h [n, B-1, H] and whose anchors
        are the tokens anchor_ids [n]: DFlash takes each slot's argmax."""
        return torch.cat([logits.argmax(-1) for logits in self.head_chunks(h)]).view(h.shape[:-1])

    @classmethod
    def own_sizes(cls, cfg: DrafterConfig) -> tuple[int, int]:
        """(parameters an architecture adds to DFlash's, the largest one's size): the memory plan's (DFlash: none)."""
        return 0, 0

    @classmethod
    def own_activations(cls, cfg: DrafterConfig, num_anchors: int, recompute: str) -> int:
        """Bytes an architecture's own parts keep for the backward of a bf16 step of A anchors, beyond what DFlash's
        layers keep (`dflash.memory`; DFlash: none)."""
        return 0

    @classmethod
    def format_refusal(cls, cfg: DrafterConfig, fmt: str) -> str | None:
        """Why the export layout `fmt` would be served otherwise than this drafter was trained (None: it would not).
        DFlash's `zlab` layout: SGLang takes the causality from the layer types alone (it reads no `is_causal`)."""
        if fmt == "zlab" and cfg.causal_block != (cfg.sliding_window is not None):
            how = ("--causal-block without --sliding-window: SGLang serves full_attention layers with the whole block"
                   if cfg.causal_block else
                   "--sliding-window without --causal-block: SGLang serves sliding_attention layers causally inside "
                   "the block (it reads no is_causal)")
            return (f"--format zlab: {how}; export --format speculators (vLLM serves it as trained) or train "
                    f"with{'out' if cfg.causal_block else ''} --causal-block")
        return None


def architectures() -> dict[str, type[Drafter]]:
    """`DrafterConfig.arch` -> its module class: the one place an architecture is chosen."""
    from dflash.dflash2 import DFlash2

    return {"dflash": Drafter, "dflash2": DFlash2}


def drafter_class(cfg: DrafterConfig) -> type[Drafter]:
    return architectures()[cfg.arch]


def build_drafter(cfg: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> Drafter:
    """The drafter `cfg` describes (its `arch`), on the target's embeddings and head [V, H]."""
    return drafter_class(cfg)(cfg, embed_weight, head_weight)
