"""What some target families need so that dflash captures, and decodes with, the states they compute
while serving.

A cached state must be prefix-invariant: token k's state depends on tokens 0..k only, as when the
target decodes one token at a time. Dense, sliding-window, MoE, MLA and GatedDeltaNet targets are so in
Hugging Face's implementations. DeepSeek Sparse Attention (GLM-5's `glm_moe_dsa`, DeepSeek-V3.2) is not:
its indexer keeps the `index_topk` best-scoring keys of each query, and the scores are ReLU'd sums, so
many are exactly 0; `topk` breaks those ties by the row's length, so a token's selected keys (and its
state) change with the tokens after it and with padding. `make_exact` gives such indexers a causal,
stable top-k: future keys never count, and among equal scores the earliest key wins, which is what the
same indexer selects when the tokens arrive one by one.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from dflash.errors import DflashError

# DSA indexers whose scoring dflash reproduces exactly: class name -> the RoPE function of its module
# (GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's the two halves).
_DSA_INDEXERS = {"GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave",
                 "DeepseekV32Indexer": "apply_rotary_pos_emb"}


def make_exact(model) -> list[str]:
    """Give every sparse-attention indexer of `model` a causal, stable top-k (in place). Returns a line
    per change for the log; refuses an indexer it does not know with a one-line error."""
    notes = []
    for name, module in model.named_modules():
        if not hasattr(module, "index_topk"):
            continue
        kind = type(module).__name__
        if kind not in _DSA_INDEXERS:
            raise DflashError(f"{model.config.model_type}: dflash does not know the sparse-attention indexer {kind} "
                              f"({name}); its states may depend on later tokens, so it is refused rather than cached")
        module.forward = types.MethodType(_causal_indexer_forward, module)
        notes.append(name)
    if not notes:
        return []
    return [f"{len(notes)} sparse-attention indexers select their top-{model.config.index_topk} keys causally "
            f"(earliest first on ties): every state depends on its prefix only"]


@torch.no_grad()
def index_scores(indexer, hidden_states, q_resid, position_embeddings, cache=None) -> torch.Tensor:
    """[B, S, T] the indexer's score of every key for every query: the same operations, in the same
    order, as the Hugging Face indexer (so the same values), before any mask."""
    B, S, _ = hidden_states.shape
    rope = getattr(sys.modules[type(indexer).__module__], _DSA_INDEXERS[type(indexer).__name__])
    rot, rest = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim)  # [B, S, h, D]
    q_rot, q_pass = torch.split(q, [rot, rest], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
    k_rot, k_pass = torch.split(k, [rot, rest], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)  # [B, T, D]: the cached keys and these
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, 1, h] @ [B, S, h, T]


def causal_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S, k] int32: per query, the k best allowed keys, the earliest first among equal scores (a
    stable sort), so a query's choice never depends on how many keys follow it.

    The serving engines define no tie rule to match: vLLM's and SGLang's default indexer top-k kernels
    (GPU radix selects) hand tied keys their slots in thread-arrival order, and their scores are fp8
    products, not these fp32 ones. Earliest first is what FlashInfer's opt-in `tie_break=1` ("prefer
    smaller indices"; SGLang's `--dsa-topk-backend flashinfer` with SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK=small)
    selects. Where a query has fewer than k allowed keys the rest of its k are disallowed ones (score
    -inf), which the attention mask drops; the engines return just the allowed keys there."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, scores.shape[-1])].to(torch.int32)


def _causal_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                            cache=None, past_key_values=None, **kwargs):
    # older transformers releases name the cache `past_key_values`
    cache = cache if cache is not None else past_key_values
    scores = index_scores(self, hidden_states, q_resid, position_embeddings, cache)
    # [B, S, T] causal (+ padding)
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return causal_topk(scores, allowed, self.index_topk)


# fla kernels whose autotuning key holds a size that changes with a forward's shape: the number of
# 65,536-row blocks of an l2norm input (rows x width x heads) and the number of rows of a cumsum. A new
# value costs a fresh autotune (25 compiles and benchmarks, ~9 s on an H200 for l2norm), so a forward of
# every new size paid it. The config changes speed only, never the result: tuned once per width instead.
_FLA_SHAPE_KEYS = {"fla.modules.norm.l2norm": {"l2norm_fwd_kernel": "NB"},
                   "fla.ops.utils.cumsum": {"chunk_local_cumsum_scalar_kernel": "B",
                                            "chunk_local_cumsum_vector_kernel": "B"}}


def tune_fla_once() -> int:
    """Drop the shape-dependent sizes from those kernels' autotuning keys; returns how many changed
    (0 where fla or a kernel is missing, or a release already keys them otherwise)."""
    import importlib

    changed = 0
    for module_name, kernels in _FLA_SHAPE_KEYS.items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # no fla, or no Triton
            continue
        for name, size in kernels.items():
            tuner = getattr(module, name, None)
            while tuner is not None and not hasattr(tuner, "keys"):  # under triton.heuristics
                tuner = getattr(tuner, "fn", None)
            if size in getattr(tuner, "keys", ()):
                tuner.keys = [k for k in tuner.keys if k != size]
                changed += 1
    return changed


def has_linear_attention(model) -> bool:
    return any("GatedDeltaNet" in type(m).__name__ for m in model.modules())
