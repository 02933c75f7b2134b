"""DFlash2: the DFlash drafter (`dflash.drafter`) with a grouped dynamic causal convolution over the tokens of
each block around every attention and MLP sublayer, and a low-rank candidate selector that picks each slot's
draft among the top-K tokens of its unary logits given the token drafted before it.

    conv of a sublayer (side 0 on its normed input, side 1 on its output before the residual add; both sides'
    dynamic taps come from one projection of the normed input):
        delta_0, delta_1 = kernel_projection(x)                                         # [N, 2, K, H/G]
        out[t, c] = sum over taps o < K with o <= slot(t) of (base[s, o, c] + delta_s[t, o, c // G]) x[t - o, c]
    layer:    h += finish(self_attn(prepare(input_layernorm(h))))
              h += finish(mlp(prepare(post_attention_layernorm(h))))
    selector: score(prev -> c) = unary(c) + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>
              for the K candidates c of a slot (unary = the target's head on the final normed state h)
    draft:    greedy from the anchor: slot 1's prev is the anchor, each next slot's the candidate chosen before it
    loss:     the unary loss + alpha * the K-way cross-entropy of the scores, with the label put in place of the
              K-th candidate where it is missing and prev teacher-forced from the data (the token before the
              slot), weighted per slot as the unary loss

A tap never reaches across a block's start, so every block is convolved alone: A blocks side by side in
training, one while decoding. At initialisation the convolutions are the identity (tap 0 of the base 1, the rest
and the projection 0): the drafter starts as DFlash; the selector's weights start normal(0, std).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import DrafterConfig
from dflash.drafter import Drafter, Layer


def training_candidates(cand: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates the selector learns from: each row's unary top-K cand [R, K] (sorted), the label [R] put in
    place of the K-th, the lowest, where it is missing; and the label's place among them [R]."""
    hit = cand == labels[:, None]  # [R, K]: at most one per row (top-K indices are distinct)
    found = hit.any(1)
    train = torch.cat([cand[:, :-1], torch.where(found, cand[:, -1], labels)[:, None]], 1)
    return train, torch.where(found, hit.long().argmax(1), cand.shape[1] - 1)


class BlockConv(nn.Module):
    """The grouped dynamic causal depthwise convolution around one sublayer: `prepare` convolves its input (side 0)
    and keeps side 1's taps, `finish` convolves its output with them."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, K = cfg.hidden_size, cfg.conv_kernel_size
        self.block_size, self.taps, self.groups = cfg.block_size, K, H // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, K, H))
        self.kernel_projection = nn.Linear(H, 2 * K * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: out = x."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (whole blocks) -> (its side-0 convolution [N, H], side 1's dynamic taps [N, K, H/G])."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))  # [N, 2, K, H/G]
        return self.convolve(x, delta[:, 0], 0), delta[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, delta, 1)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [N, H], taps delta [N, K, H/G] of each output token -> [N, H]. Channels as [H/G groups, G]: a group's
        dynamic tap broadcasts over its G channels, never expanded to [N, K, H]. Tap o is summed as each source
        token's contribution to the token o slots later, (base[o] + delta[t + o, o]) x[t], shifted into place: the
        backward then needs x and the taps only, never a shifted copy of x."""
        N, H = x.shape
        B, K, n = self.block_size, self.taps, self.groups
        blocks = x.view(N // B, B, n, H // n)  # [A, B, H/G, G]
        base = self.base_kernel[side].view(K, n, H // n)
        delta = delta.view(N // B, B, K, n, 1)
        out = 0
        for o in range(K):  # zeros before the block's start: a tap never crosses it
            taps = delta[:, :, o] if o == 0 else F.pad(delta[:, o:, o], (0, 0, 0, 0, 0, o))  # [A, B, H/G, 1] by source
            # two products, not blocks * (base + taps): the sum would be a full-width tap tensor kept for the backward
            part = blocks * base[o] + blocks * taps
            out = out + (part if o == 0 else F.pad(part[:, : B - o], (0, 0, 0, 0, o, 0)))
        return out.view(N, H).to(x.dtype)


class DFlash2Layer(Layer):
    """A DFlash layer with a `BlockConv` around each sublayer, after its pre-norm and before the residual add."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.attention_conv = BlockConv(cfg)
        self.mlp_conv = BlockConv(cfg)

    def attention(self, y, ctx_kv, rope_q, attend) -> torch.Tensor:
        x, late = self.attention_conv.prepare(self.input_layernorm(y))
        return self.attention_conv.finish(self.self_attn(x, ctx_kv, rope_q, attend), late)

    def feed_forward(self, y) -> torch.Tensor:
        x, late = self.mlp_conv.prepare(self.post_attention_layernorm(y))
        return self.mlp_conv.finish(self.mlp(x), late)


class CandidateSelector(nn.Module):
    """The low-rank pairwise score of a candidate given its predecessor (codebooks are plain parameters: the
    export's names carry no `.weight`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, V, r = cfg.hidden_size, cfg.vocab_size, cfg.selector_rank
        self.hidden_projection = nn.Linear(H, r, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(V, r))
        self.successor_codebook = nn.Parameter(torch.empty(V, r))

    @torch.no_grad()
    def reset_parameters(self, std: float, g: torch.Generator) -> None:
        for p in self.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)

    def query(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """A[prev] * P h [..., Kp, r] for states h [..., H] and predecessors prev [..., Kp]."""
        return self.predecessor_codebook[prev] * self.hidden_projection(h)[..., None, :]

    def pair_scores(self, h: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """<A[prev] * P h, B[cand]> [..., Kp, K] for states h [..., H], predecessors prev [..., Kp] and candidates
        cand [..., K] (every predecessor with every candidate)."""
        return self.query(h, prev) @ self.successor_codebook[cand].transpose(-1, -2)

    @torch.no_grad()
    def walk(self, h: torch.Tensor, anchor: torch.Tensor, values: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """The greedy drafts [n, S] of blocks: h [n, S, H] the final states of slots 1..S, anchor [n] their anchor
        tokens, values / cand [n, S, K] each slot's unary top-K (sorted: a tie goes to the higher unary logit, as
        vLLM's walk breaks it). Every edge (predecessor candidate -> candidate) is scored at once, as vLLM does;
        the walk then only gathers: slot 1 starts from the anchor, each next slot from the candidate chosen."""
        n, S, K = cand.shape
        prev = torch.cat([anchor[:, None, None].expand(n, 1, K), cand[:, :-1]], 1)  # [n, S, K] possible predecessors
        edges = values[:, :, None, :].float() + self.pair_scores(h, prev, cand).float()  # [n, S, K, K]
        at = torch.zeros(n, dtype=torch.long, device=cand.device)  # slot 1: every row holds the anchor
        chosen = []
        for j in range(S):
            at = edges[:, j].gather(1, at[:, None, None].expand(n, 1, K))[:, 0].argmax(-1)  # [n]
            chosen.append(at)
        return cand.gather(2, torch.stack(chosen, 1)[..., None])[..., 0]


class DFlash2(Drafter):
    """The DFlash2 drafter: parameters as DFlash2's export names them (`layers.{i}.attention_conv.base_kernel`,
    `candidate_selector.predecessor_codebook`, ...)."""

    layer_class = DFlash2Layer
    architecture = "DFlash2DraftModel"
    export_keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    explicit_causality = True  # as the released DFlash2 config: its loaders read `is_causal`

    @property
    def candidates(self) -> int:
        return self.cfg.selector_top_k

    def add_modules(self, cfg: DrafterConfig) -> None:
        self.candidate_selector = CandidateSelector(cfg)

    def own_parameters(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.startswith("candidate_selector.") or "_conv." in n}

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int = 0) -> torch.Generator:
        g = super().reset_parameters(std, seed)
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector.reset_parameters(std, g)
        return g

    def extra_loss(self, h, labels, weights, candidates, prev, alpha):
        """alpha * sum of weights x the selector's K-way cross-entropy: the candidates are the unary top-K with the
        label in place of the K-th where it is missing; their unary logits are recomputed as h . W_head[c] (K rows
        of the head gathered), so the selector's gradient reaches h through them too. Drafts: the greedy walk over
        the strict top-K, as decoding does."""
        values, cand = candidates  # [R, K] each, without gradient
        A, S = prev.shape
        K = cand.shape[1]
        train_cand, gold = training_candidates(cand, labels)
        # gathers multiplied and summed, not batched matmuls: compiled, each is one fused kernel that the backward
        # recomputes from the indices, where a matmul's gathered operand [R, K, H] would be kept for it
        unary = (self.head_weight[train_cand].float() * h[:, None, :].float()).sum(-1)  # [R, K]
        selector = self.candidate_selector
        query = selector.query(h, prev.reshape(-1, 1)).float()  # [R, 1, r]
        scores = unary + (selector.successor_codebook[train_cand].float() * query).sum(-1)
        ce = scores.logsumexp(-1) - scores.gather(1, gold[:, None])[:, 0]  # [R]
        drafts = self.candidate_selector.walk(h.view(A, S, -1), prev[:, 0], values.view(A, S, K), cand.view(A, S, K))
        return alpha * (weights * ce).sum(), drafts

    def propose(self, h: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The selector's greedy walk over each slot's top-K unary candidates, from the anchor."""
        tops = [logits.float().topk(self.cfg.selector_top_k) for logits in self.head_chunks(h)]
        shape = (*h.shape[:-1], self.cfg.selector_top_k)  # [n, B-1, K]
        values, cand = torch.cat([t.values for t in tops]).view(shape), torch.cat([t.indices for t in tops]).view(shape)
        return self.candidate_selector.walk(h, anchor_ids, values, cand)

    @classmethod
    def own_sizes(cls, cfg: DrafterConfig) -> tuple[int, int]:
        H, K, r, V = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank, cfg.vocab_size
        conv = 2 * K * H + 2 * K * (H // cfg.conv_group_size) * H  # base kernel + kernel projection
        return cfg.num_layers * 2 * conv + r * H + 2 * V * r, V * r

    @classmethod
    def own_activations(cls, cfg: DrafterConfig, num_anchors: int, recompute: str) -> int:
        """Per block token and convolution: its taps (2 sides x K x H/G) and, beside DFlash's, its input (side 0's,
        for the projection's gradient) and its sublayer's output (side 1's), bf16; a recomputed sublayer keeps
        none of its convolution's. Per head row: the final state, the selector's queries and the candidates' ids
        and scores (the gathered head and codebook rows are recomputed in the backward). Counted from the tensors
        the compiled step keeps (`bench/kept.py`, CPU); not yet measured on a GPU."""
        H, K, r, B = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank, cfg.block_size
        N, R, k = num_anchors * B, num_anchors * (B - 1), cfg.selector_top_k
        conv = N * (4 * K * (H // cfg.conv_group_size) + 4 * H)
        kept = {"none": 2, "mlp": 1, "attention": 1, "layers": 0}[recompute]
        return cfg.num_layers * kept * conv + R * (2 * H + 12 * k + 6 * r)

    @classmethod
    def format_refusal(cls, cfg: DrafterConfig, fmt: str) -> str | None:
        if fmt == "speculators":
            return ("--format speculators: vLLM serves a DFlash2 drafter from the zlab layout (architectures "
                    "[\"DFlash2DraftModel\"]), not from speculators' own DFlash2 config; export --format zlab")
        return None
