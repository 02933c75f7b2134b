"""`dflash spec`: greedy speculative decoding with a Hugging Face target and a DFlash (or DFlash2) drafter.

A cycle: the drafter fills a block [bonus, MASK x (B-1)] in one forward, conditioned on the target's
captured states of every token so far (its per-layer context keys/values are cached), and drafts greedily
from it (DFlash: each slot's argmax; DFlash2: its selector's walk over each slot's top-K from the bonus);
the target verifies the block in one forward; the drafted tokens are kept while they equal the target's own
greedy choices, and the target's next choice is the new bonus token. The output must equal the
target's plain greedy decoding: `lossless` checks it prompt by prompt.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.drafter import Drafter
from dflash.errors import DflashError
from dflash.target import Target, decoder_layers

log = logging.getLogger(__name__)


def crop_context(ctx_kv: list, ctx_start: int, n: int, window: int | None) -> tuple[list, int]:
    """The drafter's per-layer context keys/values (positions ctx_start .. n-1) without those no slot of a
    block at n or later can see again (slot 0 sees p > n - W): a windowed drafter's cache stays W - 1 long."""
    if window is None or n - ctx_start <= window - 1:
        return ctx_kv, ctx_start
    drop = n - (window - 1) - ctx_start
    return [(k[:, drop:], v[:, drop:]) for k, v in ctx_kv], ctx_start + drop


def block_attention_fn(n: int, ctx_start: int, block_size: int, window: int | None, causal: bool, device):
    """Attention of the block at positions n .. n+B-1 over the cached context (positions ctx_start .. n-1)
    and itself: all of it, or with a sliding window W, slot k sees context positions p > n + k - W;
    `causal`: slot k sees block slots 0..k."""
    if window is None and not causal:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ctx_pos = torch.arange(ctx_start, n, device=device)
    slot_pos = torch.arange(n, n + block_size, device=device)
    ctx = ctx_pos[None, :] > slot_pos[:, None] - (window if window is not None else n + block_size)
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    mask = torch.cat([ctx, own.tril() if causal else own], 1)  # [B, ctx + B]
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _argmax_head(target: Target, h: torch.Tensor) -> torch.Tensor:
    return target.head(h).argmax(-1)


class RewindableCache:
    """The target's cache while decoding speculatively: after each verification it keeps only the accepted
    tokens. Attention layers crop their keys and values.
    Linear-attention (GatedDeltaNet) layers keep one recurrent state, not one per token. Where transformers
    can record the state after each token of a forward (`activate_past_recording(recurrent_states_to_keep=)`,
    from 5.25), the verification records them and the crop restores the one after the accepted tokens.
    Before that release, the state is put back as it was before the block and the layer's mixer replays the
    accepted tokens from the inputs it got in the verification (a pre-hook keeps them): a token's input to a
    layer does not depend on the tokens after it, so these are the inputs a forward of the accepted tokens
    alone would give, and the mixer alone (not the whole target) runs again."""

    def __init__(self, target: Target):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        self.cache = DynamicCache(config=target.model.config)
        for i, layer in enumerate(self.cache.layers):  # sliding-window layers keep every key (the attention
            if type(layer) is DynamicSlidingWindowLayer:  # mask applies the window), so a crop is exact in
                self.cache.layers[i] = DynamicLayer()  # every release (5.17's recorded window mis-sized its mask)
        self.mixers = _linear_mixers(target, self.cache)  # {layer index: its linear-attention module}
        self.native = records_recurrent_states()
        # linear-attention layers keep the convolution inputs (and, natively, the recurrent states) a crop needs
        self.cache.activate_past_recording(**({"recurrent_states_to_keep": 0} if self.native else {}))
        self._inputs: dict[int, tuple] = {}
        self._saved: dict[int, dict] = {}
        self.device = target.device
        self.replay_s = 0.0  # time spent rolling linear-attention layers back by replaying their mixers
        self._hooks = [] if self.native else [m.register_forward_pre_hook(self._keep_inputs(i), with_kwargs=True)
                                              for i, m in self.mixers.items()]

    def _keep_inputs(self, i: int):
        def hook(module, args, kwargs):
            self._inputs[i] = (args, kwargs)
        return hook

    def save(self, verified: int) -> None:
        """Before a verification of `verified` tokens: natively, record the state after each of them (the
        prompt's forward records none: it runs chunked); else keep the states the block will advance."""
        for i in self.mixers:
            if self.native:
                self.cache.layers[i].recurrent_states_to_keep = verified
            else:
                self._saved[i] = {s: x.clone() for s, x in self.cache.layers[i].recurrent_states.items()
                                  if x is not None}

    def rewind(self, verified: int, keep: int) -> None:
        """Keep the first `keep` of the `verified` tokens the last forward added. A negative crop removes
        that many tokens in every transformers 5 release (the positive one changed meaning)."""
        replay = not self.native and keep < verified and self.mixers
        t0 = time.perf_counter()
        for i, layer in enumerate(self.cache.layers):
            if i not in self.mixers or self.native:
                layer.crop(keep - verified)
            elif keep == verified:
                layer.crop(0)  # trims the recorded convolution inputs back to the kernel's width
            else:
                layer.crop(-verified)  # the convolution state before the block
                for s, x in self._saved[i].items():
                    layer.recurrent_states[s].copy_(x)
                args, kwargs = self._inputs[i]
                self.mixers[i](*_first_tokens(args, verified, keep), **_first_tokens(kwargs, verified, keep))
        if replay:
            _sync(self.device)  # host sync for the timing, once (the decode loop syncs every cycle anyway)
            self.replay_s += time.perf_counter() - t0
        self._inputs.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def records_recurrent_states() -> bool:
    """Whether this transformers release records a linear-attention layer's state after each token of a
    forward, for a crop to restore (5.25 on)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    params = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    return "recurrent_states_to_keep" in params


def _linear_mixers(target: Target, cache) -> dict:
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    layers = decoder_layers(target.model, target.num_layers)
    mixers = {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        mixer = getattr(layers[i], "linear_attn", None)
        if mixer is None or isinstance(layer, DynamicLayer):
            raise DflashError(f"dflash spec: {target.config.model_type}'s layer {i} keeps a recurrent state of a kind "
                              f"dflash cannot rewind yet ({type(layer).__name__}, {type(layers[i]).__name__})")
        mixers[i] = mixer
    return mixers


def _first_tokens(args, verified: int, keep: int):
    """The mixer's arguments cut to the first `keep` tokens: tensors whose sequence dimension (1, or 0
    for vectors such as cache positions) holds the `verified` tokens."""
    def cut(x):
        if not torch.is_tensor(x):
            return x
        if x.ndim >= 2 and x.shape[1] == verified:
            return x[:, :keep]
        return x[:keep] if x.ndim == 1 and x.shape[0] == verified else x
    return {k: cut(v) for k, v in args.items()} if isinstance(args, dict) else [cut(v) for v in args]


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if i is not None}


@torch.inference_mode()
def target_greedy(target: Target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """The target alone: one token per forward, with a KV cache."""
    from transformers import DynamicCache

    device = target.device
    cache = DynamicCache(config=target.model.config)
    _, last = target.forward(torch.tensor([prompt], device=device), cache)
    out = [int(_argmax_head(target, last[0, -1]))]
    while len(out) < max_new and out[-1] not in eos:
        _, last = target.forward(torch.tensor([[out[-1]]], device=device), cache)
        out.append(int(_argmax_head(target, last[0, -1])))
    return out


@torch.inference_mode()
def speculative_greedy(target: Target, drafter: Drafter, prompt: list[int], max_new: int,
                       eos: set[int], stats: dict | None = None) -> tuple[list[int], list[int]]:
    """(tokens, accepted draft tokens per cycle); `stats["replay_s"]` adds the time spent rolling
    linear-attention layers back."""
    cache = RewindableCache(target)
    try:
        out, accepted = _decode(target, drafter, cache, prompt, max_new, eos)
    finally:
        cache.close()
    if stats is not None:
        stats["replay_s"] = stats.get("replay_s", 0.0) + cache.replay_s
    out = _cut(out, max_new, eos)
    if accepted:  # the last cycle may run past max_new or an end token: count only what it kept
        accepted[-1] = len(out) - 2 - sum(a + 1 for a in accepted[:-1])
    return out, accepted


def _decode(target: Target, drafter: Drafter, cache: RewindableCache, prompt, max_new, eos):
    cfg = drafter.cfg
    B, W, device = cfg.block_size, cfg.sliding_window, target.device
    hidden, last = target.forward(torch.tensor([prompt], device=device), cache.cache)
    n = len(prompt)
    ctx_kv = drafter.context_kv(drafter.context(torch.stack(hidden, 2)[0]), torch.arange(n, device=device))
    ctx_start = 0  # position of the first context key kept
    bonus = int(_argmax_head(target, last[0, -1]))
    out, accepted = [bonus], []
    mask_block = torch.full((B,), cfg.mask_token_id, device=device)
    while len(out) < max_new and out[-1] not in eos:
        ctx_kv, ctx_start = crop_context(ctx_kv, ctx_start, n, W)
        block = mask_block.clone()
        block[0] = bonus
        attend = block_attention_fn(n, ctx_start, B, W, cfg.causal_block, device)
        h = drafter(None, None, block, torch.arange(n, n + B, device=device), attend, ctx_kv=ctx_kv)
        draft = drafter.propose(h[None, 1:], block[:1])[0]  # [B-1] greedy drafts (DFlash2: the selector's walk)
        cache.save(B)
        hidden, last = target.forward(torch.cat([block[:1], draft])[None], cache.cache)  # verify positions n..n+B-1
        choice = _argmax_head(target, last[0])  # [B]: the target's token after each verified position
        a = int((draft == choice[:-1]).long().cumprod(0).sum())
        new_tokens = draft[:a].tolist() + [int(choice[a])]
        out += new_tokens
        accepted.append(a)
        if eos.intersection(new_tokens):
            break
        cache.rewind(B, a + 1)  # keep the bonus and the accepted tokens
        new = drafter.context(torch.stack(hidden, 2)[0, : a + 1])
        kv = drafter.context_kv(new, torch.arange(n, n + a + 1, device=device))
        ctx_kv = [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1)) for (k0, v0), (k1, v1) in zip(ctx_kv, kv)]
        n, bonus = n + a + 1, int(choice[a])
    return out, accepted


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def ngram_accepted(tokens: list[int], start: int, block_size: int, max_n: int = 3) -> list[int]:
    """Accepted draft tokens per cycle of n-gram copy (prompt-lookup) decoding replayed over a greedy
    output `tokens[start:]` (the prompt before it): each cycle copies the B-1 tokens that followed the
    latest earlier occurrence of the last n known tokens, longest n first (n = max_n..1; transformers'
    prompt lookup takes the earliest match, n <= 2). Greedy output is fixed, so this is exactly what
    that drafter earns in `speculative_greedy` (tested): the baseline a trained drafter must beat on
    repetitive text."""
    accepted, n = [], start + 1  # the first new token is the target's own (prefill)
    while n < len(tokens):
        proposal = []
        for k in range(min(max_n, n), 0, -1):
            key = tokens[n - k : n]
            j = next((j for j in range(n - k - 1, -1, -1) if tokens[j : j + k] == key), None)
            if j is not None:
                proposal = tokens[j + k : min(j + k + block_size - 1, n)]
                break
        a = 0
        while a < len(proposal) and n + a < len(tokens) and proposal[a] == tokens[n + a]:
            a += 1
        accepted.append(min(a, len(tokens) - n - 1))  # as speculative_greedy counts a cut last cycle
        n += a + 1
    return accepted


def read_prompts(path: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Prompts from JSONL: `messages` rows (up to the last user turn, with the generation prompt) or
    `prompt` / `text` rows (raw text)."""
    from dflash.data import chat_prompt_ids, jsonl_rows

    prompts = []
    for where, row in jsonl_rows(path):
        if "messages" in row:
            msgs = row["messages"]
            last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
            if last_user is None:
                raise DflashError(f"{where}: a prompt needs a user turn")
            ids = chat_prompt_ids(tokenizer, msgs[: last_user + 1])
        elif isinstance(row.get("prompt", row.get("text")), str):
            ids = tokenizer(row.get("prompt", row.get("text")))["input_ids"]
        else:
            raise DflashError(f"{where}: row has neither 'messages' nor 'prompt'/'text'")
        prompts.append(ids)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DflashError(f"{path}: no prompts")
    return prompts


def run_spec(target_name: str, drafter_path: str, prompts_path: str, max_new: int = 128, limit: int | None = None,
             device: str = "auto", dtype: str = "auto", save_outputs: str | None = None) -> dict:
    """Decode every prompt speculatively and with the target alone; `save_outputs`: a JSONL of
    {"prompt", "completion"} rows (the target's answers: a cache of them gives the offline tau to
    compare)."""
    from dflash.drafter_io import load_drafter
    from dflash.evaluate import by_slot, per_request_tau
    from dflash.target import load_target, resolve_device, resolve_dtype, resolve_target, text_config

    dev = resolve_device(device)
    model, tokenizer = load_target(resolve_target(target_name), dev, resolve_dtype(dtype, dev))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    drafter, _ = load_drafter(drafter_path, embed, head, device=dev)
    depth = text_config(model.config).num_hidden_layers
    if max(drafter.cfg.target_layer_ids) >= depth:
        raise DflashError(f"--drafter {drafter_path} reads target layers {drafter.cfg.target_layer_ids}; "
                          f"{target_name} has {depth} (ids 0..{depth - 1})")
    target = Target(model, drafter.cfg.target_layer_ids)
    eos = eos_ids(model, tokenizer)
    prompts = read_prompts(prompts_path, tokenizer, limit)
    speculative_greedy(target, drafter, prompts[0][:8], 4, eos)  # warm-up
    target_greedy(target, prompts[0][:8], 4, eos)
    t_spec = t_base = 0.0
    n_spec = n_base = 0
    accepted, mismatches, ngram, outputs, stats = [], [], [], [], {"replay_s": 0.0}  # accepted: per prompt
    for i, prompt in enumerate(prompts):
        _sync(dev)
        t0 = time.perf_counter()
        spec, acc = speculative_greedy(target, drafter, prompt, max_new, eos, stats)
        _sync(dev)
        t1 = time.perf_counter()
        base = target_greedy(target, prompt, max_new, eos)
        _sync(dev)
        t2 = time.perf_counter()
        t_spec, t_base, n_spec, n_base = t_spec + t1 - t0, t_base + t2 - t1, n_spec + len(spec), n_base + len(base)
        accepted.append(acc)
        ngram += ngram_accepted(prompt + base, len(prompt), drafter.cfg.block_size)
        outputs.append({"prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(base)})
        if spec != base:
            mismatches.append(i)
    if save_outputs:
        Path(save_outputs).parent.mkdir(parents=True, exist_ok=True)
        Path(save_outputs).write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))
    B, steps = drafter.cfg.block_size, [a for acc in accepted for a in acc]
    per_position = by_slot(steps, B)
    return {"tau": sum(a + 1 for a in steps) / max(len(steps), 1), "tau_per_request": per_request_tau(accepted),
            "lossless": not mismatches,
            "ngram_tau": sum(a + 1 for a in ngram) / max(len(ngram), 1),
              "speedup": (n_spec / t_spec) / (n_base / t_base), "per_position": per_position,
              "spec_tokens_per_s": n_spec / t_spec, "target_tokens_per_s": n_base / t_base,
              "linear_attention_replay_share": stats["replay_s"] / t_spec,
              "prompts": len(prompts), "new_tokens": n_spec, "cycles": len(steps), "mismatched_prompts": mismatches,
              "block_size": B}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
