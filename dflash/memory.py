"""What a training step holds in GPU memory: the plan `dflash train` makes before it compiles (the step's peak,
estimated by parts, and the options that would make it fit), an out-of-memory said in one line, and the leaner
optimizer state (`BF16AdamW`).

The estimate is for the compiled GPU step (bf16 autocast, flex attention, CUDA graphs), in bytes, with P the
drafter's trained parameters, N = A B block tokens, R = A (B - 1) head rows, widths H (hidden), Q = heads x head_dim,
K = key/value heads x head_dim, M (MLP), V (vocabulary), L captured layers, n drafter layers:

    kept     = P (4 weights + 8 AdamW moments, 4 with --optimizer-state bf16)   [+ 4 P DDP buckets over ranks]
    frozen   = 4 V H (the target's bf16 embeddings and head) + 8 (T + B) head_dim (RoPE tables)
    inputs   = 2 x (L T H x 2 bytes (fp8: 1, + its scales) + 9 T + 4 D): the step's buffers and the loader's staging
    layer    = N (4 H residuals + 8 Q + 8 K attention + 6 M MLP) + 8 T K context keys/values   (bf16 activations)
    acts     = n x layer (or what --recompute keeps of it) + 2 T L H (fc's input) + 8 R H (head rows and their
               gradient) + 2 P (bf16 copies of the weights) + what the architecture adds (`Drafter.own_activations`:
               DFlash2's convolutions and selector), x budget_share(--activation-memory-budget)
    chunk    = 6 c V (the cross-entropy chunk's bf16 logits and their fp32 copy; 5 chunks unrolled)
    peak     = max(kept + frozen + inputs + acts + chunk                       at the end of the forward,
                   ... + acts + a recomputed sublayer + one layer's gradients   early in the backward (--recompute;
                                                                                  a whole layer: + 4 N M, its MLP's
                                                                                  input gradients),
                   kept + 4 P + frozen + inputs (+ bf16 moments' fp32 scratch)  at the optimizer step)

Gradients (4 P) exist only from the backward to the optimizer step (they are freed after it), while the
activations shrink. `layer` counts, per block token, the two residual states, the queries before and after their
norm and RoPE, the attention's output and its copy for o_proj, the block's keys and values (before and after,
and concatenated with the context's) and the MLP's gate, up and their product. Against ten peaks that
`torch.cuda.max_memory_allocated` measured on an H200 (Qwen3-8B, GLM-5- and Qwen3.5-27B-sized drafters, T = 3072
to 49,152, 512 to 4,096 anchors, three chunk sizes, the chunk as a region or unrolled) it is within 3.5 %, and
within 2 % of six that an H100 measured with --recompute mlp / attention / layers and bf16 moments; it is 4.8 %
short of the GLM-5-sized step at 8,192 anchors with --recompute mlp (129.9 GB on an H200), whence `HEADROOM`.
Under `--activation-memory-budget` the partitioner keeps more than the budget's share (`budget_share`, measured
once); an uncompiled step keeps more.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomRuntimeEstimator

from dflash.config import DrafterConfig
from dflash.drafter import drafter_class

GB = 1e9
CHUNK_BYTES = 6  # per logit of a cross-entropy chunk: bf16 logits + their fp32 copy
UNROLLED_CHUNKS = 5  # --no-compile-regions: unrolled chunks overlap in Inductor's schedule (measured: ~5 chunks' worth)


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What the step's memory depends on: the drafter, the shard's shape and how the step runs."""

    drafter: DrafterConfig  # resolved
    T: int  # tokens per shard
    A: int  # anchors
    D: int  # documents per shard
    ce_chunk: int  # cross-entropy rows per chunk
    scale_block: int | None = None  # fp8 cache: channels per scale (None: bf16 states)
    compiled: bool = True
    regions: bool = True  # the cross-entropy chunk as one compile region
    optimizer_state: str = "fp32"
    budget: float = 1.0  # --activation-memory-budget
    recompute: str = "none"
    world: int = 1  # DDP ranks
    prefetch: int = 3  # shards read ahead into pinned host memory


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate, in bytes: the step's peak, where it is, and what is alive then (`parts`, summing to it)."""

    peak: int
    at: str  # "the end of the forward", "the backward" (of a recomputed sublayer) or "the optimizer step"
    parts: dict[str, int]
    host_pinned: int  # the loader's ring of pinned host buffers (host memory, not the GPU's)

    def describe(self) -> str:
        """`~44.3 GB at the end of the forward (weights and optimizer state 12.6 GB, ...)`: one line."""
        return f"~{size(self.peak)} at {self.at} (" + ", ".join(f"{k} {size(v)}" for k, v in self.parts.items()) + ")"


def size(n: float) -> str:
    """Bytes as people read them: `44.3 GB`, `12 MB`, `3 kB`."""
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def trainable_parameters(d: DrafterConfig) -> tuple[int, int]:
    """(P, the largest parameter's size) of the drafter: fc, its norms and the layers, and what its architecture
    adds (DFlash2: convolutions, the selector) (the target's embeddings and head are frozen buffers)."""
    H, Q, K, M = widths(d)
    fc = len(d.target_layer_ids) * H * H
    layer = H * Q + 2 * H * K + Q * H + 3 * H * M + 2 * H + 2 * d.head_dim
    own, own_largest = drafter_class(d).own_sizes(d)
    return d.num_layers * layer + fc + 2 * H + own, max(fc, H * Q, H * K, H * M, own_largest)


def widths(d: DrafterConfig) -> tuple[int, int, int, int]:
    """(H, Q, K, M): hidden, query heads x head_dim, key/value heads x head_dim, MLP."""
    return (d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim,
            d.intermediate_size)


def layer_activations(s: StepShape) -> tuple[int, int]:
    """(bytes one layer keeps for the backward, bytes its backward recomputes at once) under `s.recompute`."""
    d = s.drafter
    H, Q, K, M = widths(d)
    N = s.A * d.block_size
    residual, attention, mlp, context = 4 * H * N, (8 * Q + 8 * K) * N, 6 * M * N, 8 * K * s.T
    whole = residual + attention + mlp + context
    # a recomputed whole layer is alive beside its MLP's gradients (gate's and up's, bf16 [N, M] each): an H100
    # measured that much more than `whole` under --recompute layers (+1.8 GB at the Qwen3-8B shape, +6.1 GB for the
    # GLM-5-sized drafter at 5376 anchors), and its out-of-memory at 8192 anchors failed allocating one [N, M]
    mlp_gradients = 4 * M * N
    return {"none": (whole, 0), "mlp": (whole - mlp, mlp), "attention": (whole - attention, attention),
            "layers": (2 * H * N + context, whole + mlp_gradients)}[s.recompute]


# What --activation-memory-budget b keeps of the activations: torch bounds the kept share of what it may recompute
# (the saved tensors beyond the graph's inputs) by b, but only for the tensors its knapsack weighs; the min-cut that
# follows keeps others beside them, and the backward's recomputed tensors come on top. Measured once, on an H100
# (Qwen3-8B shape, T = 12,288, 2048 anchors): b = 0.5 peaked at 39.2 GB against 44.3 GB unbudgeted, i.e. 0.83 of the
# activations kept. Counted as a line through that point and 1 at b = 1 (0.66 at b -> 0): never less than measured.
BUDGET_FLOOR = 0.66


def budget_share(budget: float) -> float:
    """The share of the activations a compiled step keeps under `--activation-memory-budget` (see BUDGET_FLOOR)."""
    return BUDGET_FLOOR + (1 - BUDGET_FLOOR) * budget


def plan(s: StepShape) -> MemoryPlan:
    """The step's peak GPU memory by parts (the formula in this module's docstring)."""
    d = s.drafter
    H, V, B, L = d.hidden_size, d.vocab_size, d.block_size, len(d.target_layer_ids)
    P, largest = trainable_parameters(d)
    moments, scratch = (8 * P, 0) if s.optimizer_state == "fp32" else (4 * P, 16 * largest)
    ddp = 4 * P if s.world > 1 else 0
    kept = 4 * P + moments + ddp
    frozen = 4 * V * H + 8 * (s.T + B) * d.head_dim
    states = L * s.T * H * (1 if s.scale_block else 2)
    scales = L * s.T * -(-H // s.scale_block) * 2 if s.scale_block else 0
    buffer = states + scales + 9 * s.T + 4 * s.D
    per_layer, recomputed = layer_activations(s)
    acts = (d.num_layers * per_layer + 2 * s.T * L * H + 8 * s.A * (B - 1) * H + 2 * P
            + drafter_class(d).own_activations(d, s.A, s.recompute))
    if s.compiled and s.budget < 1:
        acts = int(acts * budget_share(s.budget))
    chunk = CHUNK_BYTES * min(s.ce_chunk, s.A * (B - 1)) * V * (1 if s.regions or not s.compiled else UNROLLED_CHUNKS)
    common = {"weights and optimizer state": kept, "frozen target weights": frozen, "input buffers": 2 * buffer}
    points = {"the end of the forward": {**common, "activations": acts, "cross-entropy chunk": chunk},
              "the optimizer step": {**common, "gradients": 4 * P, "optimizer scratch": scratch}}
    if recomputed:  # early in the backward: a recomputed sublayer beside everything kept, its layer's gradients
        points["the backward"] = {**common, "activations": acts, "recomputed in the backward": recomputed,
                                  "gradients": 4 * P // d.num_layers}
    at = max(points, key=lambda k: sum(points[k].values()))
    parts = {k: v for k, v in points[at].items() if v}
    return MemoryPlan(peak=sum(parts.values()), at=at, parts=parts, host_pinned=s.prefetch * buffer)


# -- what would fit ------------------------------------------------------------------------------------------

BUDGETS = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2)  # --activation-memory-budget values offered, mildest first
OPTION = {"optimizer_state": "--optimizer-state", "budget": "--activation-memory-budget", "recompute": "--recompute",
          "A": "--num-anchors"}


def options_that_fit(s: StepShape, limit: int, most: int = 3) -> list[str]:
    """Up to `most` ways to bring the step's peak under `limit` bytes, each the mildest of its kind, in the order
    the leaner optimizer state, the activation budget (compiled), recomputation, fewer anchors (which changes the
    recipe); when none fits alone, each with the leaner optimizer state: `--optimizer-state bf16 (~41.2 GB)`."""
    def peak(changes: dict) -> int:
        return plan(dataclasses.replace(s, **changes)).peak

    def mildest(base: dict, key: str, values) -> list[dict]:
        return next(([{**base, key: v}] for v in values if peak({**base, key: v}) <= limit), [])

    def kinds(base: dict) -> list[dict]:
        budgets = [b for b in BUDGETS if b < s.budget] if s.compiled else []
        heavier = [r for r in ("mlp", "layers") if RECOMPUTE_ORDER.index(r) > RECOMPUTE_ORDER.index(s.recompute)]
        return (mildest(base, "budget", budgets) + mildest(base, "recompute", heavier)
                + mildest(base, "A", _fewer_anchors(s.A)))

    lean = {"optimizer_state": "bf16"} if s.optimizer_state != "bf16" else None
    found = ([lean] if lean and peak(lean) <= limit else []) + kinds({})
    if not found and lean:
        found = kinds(lean)
    return [" ".join(f"{OPTION[k]} {v}" for k, v in c.items()) + f" (~{size(peak(c))})" for c in found[:most]]


RECOMPUTE_ORDER = ("none", "attention", "mlp", "layers")  # least memory saved first


def _fewer_anchors(A: int) -> list[int]:
    """Anchor counts to offer, most first: multiples of 256 below A (of 16 for A <= 512)."""
    step = 256 if A > 512 else 16
    return list(range((A - 1) // step * step, 0, -step))


# -- the check and an out-of-memory --------------------------------------------------------------------------


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (None elsewhere: only a GPU's memory is checked). Free counts the blocks
    this process's allocator holds unused: the driver calls them taken, but the step gets them first."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


# how close to the free memory a plan may come before it is warned of: measured peaks have run up to 5 % above the
# plan, and the allocator holds a few % more than it hands out (4.5 % at the GLM-5-sized step on an H200)
HEADROOM = 0.10


def tight(p: MemoryPlan, free: int, device) -> str | None:
    """The warning for a step that fits the plan with less than HEADROOM of the free memory to spare (None: it
    has room)."""
    if p.peak > free or p.peak <= (1 - HEADROOM) * free:
        return None
    return (f"the training step needs ~{size(p.peak)} of the {size(free)} free on {device}, less than "
            f"{HEADROOM:.0%} to spare: should it run out of memory, the run stops in one line that names what fits")


def refusal(s: StepShape, p: MemoryPlan, free: int, device) -> str | None:
    """The line that stops a step whose estimate exceeds the free memory (None: it fits), naming options that
    fit with HEADROOM to spare."""
    if p.peak <= free:
        return None
    options = options_that_fit(s, int((1 - HEADROOM) * free))
    fix = ("it fits with " + ", or ".join(options)) if options else \
        "none of --optimizer-state bf16, --activation-memory-budget, --recompute or fewer --num-anchors fits it"
    return (f"the training step needs {p.describe()} but {device} has {size(free)} free: {fix} "
            f"(--no-memory-check tries anyway)")


def error_chain(e: BaseException | None):
    """e and the errors inside it (a CUDA error may come wrapped in a compile's or a CUDA-graph recording's)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory, raised as itself or inside another error (a compile, a CUDA-graph recording)."""
    return any(isinstance(x, torch.OutOfMemoryError) or re.search(r"\bout of memory\b", str(x), re.IGNORECASE)
               for x in error_chain(e))


def allocator_said(e: BaseException) -> str:
    """What torch's out-of-memory message says of the allocation that failed, as " (torch tried to allocate 2.00
    GiB with 1.2 GiB free)", or "" without torch's "Tried to allocate" figure: how far the plan was short."""
    text = " ".join(map(str, error_chain(e)))
    tried = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    free = re.search(r"of which ([\d.]+ [KMGT]?i?B) is free", text)
    if not tried:
        return ""
    return f" (torch tried to allocate {tried[1]}" + (f" with {free[1]} free)" if free else ")")


# -- what a compiled step keeps -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kept:
    """A tensor the forward of a compiled step keeps for its backward."""

    name: str  # its node in the forward graph
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    is_input: bool  # a parameter, buffer or argument kept as it is: no memory of its own


def kept_for_backward(fn, *args, **kwargs) -> list[Kept]:
    """What `fn(*args, **kwargs)` compiled keeps for its backward, as the partitioner Inductor runs decides it: traced
    and partitioned (the same min-cut, the same activation budget under `torch._functorch.config`), then run
    eagerly, not code-generated, so seconds on a CPU for any shape it can run. Resets torch.compile's caches.
    Flex attention has no CPU backward: a CPU step attends eagerly, so its attention part differs from the GPU's."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    kept: list[Kept] = []

    def partition(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
        fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
        for n in bw.graph.nodes:  # the backward's inputs: what the forward kept, then the outputs' gradients
            v = n.meta.get("val")
            if n.op == "placeholder" and not n.name.startswith("tangents") and isinstance(v, torch.Tensor):
                kept.append(Kept(n.name, tuple(v.shape), v.dtype, v.numel() * v.element_size(), n.name in fw_inputs))
        return fw, bw

    def eager(gm, _):
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=eager, bw_compiler=eager, partition_fn=partition)

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return kept


def kept_by_training_step(d: DrafterConfig, T: int, A: int, budget: float = 1.0) -> list[Kept]:
    """`kept_for_backward` of the bf16 training step (D-PACE) of drafter `d` (random weights) on a random shard of T
    tokens in 4 documents with A anchors, on the CPU under `--activation-memory-budget` `budget`."""
    from dflash.config import TrainConfig
    from dflash.drafter import build_drafter
    from dflash.train import LossModule

    g = torch.Generator().manual_seed(0)
    H, V = d.hidden_size, d.vocab_size
    model = build_drafter(d, *(torch.randn(V, H, generator=g, dtype=torch.bfloat16) for _ in range(2)))
    model.reset_parameters(seed=0)
    model.cache_rope(T + d.block_size)
    shard = dict(hidden=torch.randn(len(d.target_layer_ids), T, H, generator=g, dtype=torch.bfloat16),
                 input_ids=torch.randint(0, V - 1, (T,), generator=g), loss_mask=torch.ones(T, dtype=torch.uint8),
                 target_ids=torch.randint(0, V - 1, (T,), generator=g),
                 doc_lens=torch.full((4,), T // 4, dtype=torch.int32), anchor_scores=torch.rand(T, generator=g))
    step = LossModule(model, TrainConfig(cache="-", out="-", num_anchors=A, loss="dpace"), "eager", autocast=False)
    with torch.autocast("cpu", torch.bfloat16), \
            torch._functorch.config.patch(activation_memory_budget=budget,
                                            activation_memory_budget_runtime_estimator=FlopRuntime()):
        return kept_for_backward(step, **shard)


# -- the activation budget's runtime estimate ---------------------------------------------------------------------

class FlopRuntime(CustomRuntimeEstimator):
    """The partitioner's runtime estimate under `--activation-memory-budget`: torch's own flop count of a node
    (what its default "flops" estimator returns), except for a node whose arguments carry no fake value to count
    on (on the GPU, torch 2.11's joint graph hands one to the knapsack and its estimator raises KeyError 'val'):
    such a node costs as much as every counted node of its graph together, so the knapsack keeps its output rather
    than recompute it. Scaled to the graph, not a constant, so that the small nodes keep their weight beside it
    in the solver's float32 sums."""

    def __init__(self):
        self._graph_flops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, node) -> float:
        try:
            return _counted_flops(node)
        except Exception:  # noqa: BLE001 - any node torch cannot count is treated alike
            graph = node.graph
            if graph not in self._graph_flops:
                self._graph_flops[graph] = sum(_counted_flops(n) for n in graph.nodes
                                               if n.op == "call_function" and _has_flop_formula(n))
            return max(self._graph_flops[graph], 1.0)

    def uuid(self) -> str:  # the AOT autograd cache key: this estimator's version
        return "dflash.memory.FlopRuntime/1"


def _has_flop_formula(node) -> bool:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    return packet in flop_registry and all("val" in a.meta for a in node.all_input_nodes)


def _counted_flops(node) -> float:
    from torch._functorch import partitioners

    with torch._functorch.config.patch(activation_memory_budget_runtime_estimator="flops"):
        return partitioners.estimate_runtime(node)


# -- the leaner optimizer state ------------------------------------------------------------------------------

M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 x (< 2^32; its low 32 bits are used), elementwise: near-uniform bits from
    consecutive inputs. Multipliers below 2^31, so that no int64 product overflows."""
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def round_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x (fp32) to a neighbouring bf16, up or down with the probabilities that make the rounding unbiased: the
    low 16 bits of `noise` (int64, uniform) are added to x's bits, then cut off (exact in bf16)."""
    bits = x.view(torch.int32) + (noise & 0xFFFF).to(torch.int32)
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)


def adamw_bf16_step(p, g, m, v, step, key, lr, b1: float, b2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update (torch's formulas, decoupled weight decay), in place, of a flat fp32 parameter p [n] with
    its gradient g [n] and bf16 moments m, v [n]; `step` (0-dim fp32, counted here) and `key` (0-dim int64, this
    parameter's own) are tensors on p's device and `lr` a number or one: a compiled update never recompiles and
    never syncs with the host. The update is computed in fp32; the moments are stored back rounded
    stochastically with noise hashed from (key, step, element)."""
    step.add_(1)
    g = g.float()
    m32 = torch.lerp(m.float(), g, 1 - b1)
    v32 = v.float() * b2 + g * g * (1 - b2)
    element = hash32(torch.arange(p.numel(), device=p.device))
    at = hash32(key ^ hash32(step.long()))  # [] this parameter at this step
    m.copy_(round_stochastic(m32, hash32(element ^ at)))
    v.copy_(round_stochastic(v32, hash32(element ^ hash32(at + 1))))
    denom = (v32 / (1 - b2**step)).sqrt() + eps
    p.mul_(1 - lr * weight_decay).sub_(lr / (1 - b1**step) * m32 / denom)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW whose two moments are kept in bfloat16: 4 bytes per parameter instead of 8; weights and gradients
    stay fp32 and each update is computed in fp32, one parameter at a time (`adamw_bf16_step`: compiled on a GPU
    into one kernel that reads and writes 20 bytes per parameter, against the 28 of torch's fused AdamW; its fp32
    scratch is the only extra memory). The moments are rounded to bf16 stochastically: rounded to nearest, the
    second moment's change per step at beta2 = 0.999 (0.1 %) is below half of bf16's spacing (0.4 %) and it
    would stop following the gradients. The noise is a function of (seed, parameter, step, element): a resumed
    run draws the same, and so does every DDP rank. The state has torch AdamW's keys (`step`, `exp_avg`,
    `exp_avg_sq`), so either optimizer resumes from the other's (`load_state_dict` converts)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, seed: int = 0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._keys: dict[int, torch.Tensor] = {}  # per parameter (by id), on its device
        self._compiled = None

    def _key(self, p: torch.Tensor, index: int) -> torch.Tensor:
        key = self._keys.get(id(p))
        if key is None:  # once per parameter (a host-to-device copy)
            key = self._keys[id(p)] = torch.tensor((self.seed * 1_000_003 + index) * 2_654_435_761 & M32,
                                                   dtype=torch.int64, device=p.device)
        return key

    def _kernel(self, device: torch.device):
        if device.type != "cuda":
            return adamw_bf16_step
        if self._compiled is None:  # every parameter's size through one graph
            self._compiled = torch.compile(adamw_bf16_step, dynamic=True)
        return self._compiled

    @torch.no_grad()
    def step(self, closure=None):
        index = 0
        for group in self.param_groups:
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                self._kernel(p.device)(p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1),
                                       state["exp_avg_sq"].view(-1), state["step"], self._key(p, index - 1),
                                       group["lr"], b1, b2, eps, wd)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this optimizer's state or torch AdamW's (its fp32 moments are rounded to nearest bf16 here)."""
        params = [p for group in self.param_groups for p in group["params"]]
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or \
                sum(len(g["params"]) for g in saved_groups) != len(params):
            raise ValueError("the saved optimizer state is for other parameters")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: saved[k] for k in ("lr", "betas", "eps", "weight_decay") if k in saved})
        self.state.clear()
        for index, saved in state_dict["state"].items():
            p = params[int(index)]
            moments = {k: saved[k].to(p.device, torch.bfloat16).contiguous() for k in ("exp_avg", "exp_avg_sq")}
            step = torch.as_tensor(saved["step"]).to(p.device, torch.float32).reshape(()).clone()
            self.state[p] = {"step": step, **moments}
