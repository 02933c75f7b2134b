"""The fixed-shape objective against the naive per-anchor reference (outputs and gradients), on random
inputs; the pieces it is made of (layout, anchors, blocks, chunked cross-entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from dflash.drafter import Drafter, DrafterConfig, rope_tables
from dflash.naive import dpace_slot_weights, naive_loss
from dflash.objective import (
    block_attention,
    ce_rows,
    context_mask,
    decay_weights,
    default_gamma,
    dense_mask,
    dpace_weights,
    drafter_loss,
    flex_block_mask,
    head_cross_entropy,
    layout,
    make_blocks,
    sample_anchors,
    sdpa_attention,
    valid_anchors,
    visible_keys,
)

V, H, B = 300, 64, 8


def tiny_config(layers=(1, 3), block_size=B, gqa=2, **fields) -> DrafterConfig:
    """4 query heads sharing key/value heads in groups of `gqa`."""
    return DrafterConfig(num_layers=2, hidden_size=H, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=4 // gqa, head_dim=16, block_size=block_size,
                         target_layer_ids=list(layers), mask_token_id=V - 1, vocab_size=V, rope_theta=10000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, **fields)


def tiny_drafter(seed=0, layers=(1, 3), block_size=B, gqa=2, **fields) -> Drafter:
    cfg = tiny_config(layers, block_size, gqa, **fields)
    g = torch.Generator().manual_seed(seed)
    model = Drafter(cfg, torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2)
    model.reset_parameters(std=0.1, seed=seed)
    return model


def random_shard(seed=0, T=96, doc_lens=(30, 25, 20), D=6, L=2):
    g = torch.Generator().manual_seed(seed)
    lens = torch.zeros(D, dtype=torch.int32)
    lens[: len(doc_lens)] = torch.tensor(doc_lens)
    used = int(lens.sum())
    input_ids = torch.randint(0, V - 1, (T,), generator=g)
    loss_mask = (torch.rand(T, generator=g) > 0.15).to(torch.uint8)
    input_ids[used:], loss_mask[used:] = 0, 0
    target_ids = torch.randint(0, V - 1, (T,), generator=g)
    hidden = torch.randn(T, L, H, generator=g)
    hidden[used:] = 0
    return dict(hidden=hidden, input_ids=input_ids, loss_mask=loss_mask, target_ids=target_ids, doc_lens=lens)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# shard case -> (document lengths, anchors requested)
SHARDS = {"packed": ((30, 25, 20), 10), "more anchors than valid positions": ((30, 25, 20), 90),
          "two-token documents": ((2, 2, 30, 2, 25, 2), 64)}


@pytest.mark.parametrize("shard_case", list(SHARDS))
@pytest.mark.parametrize("labels_from", ["target", "data"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_fast_loss_and_gradients_match_the_naive_reference(block_size, gqa, labels_from, shard_case):
    doc_lens, num_anchors = SHARDS[shard_case]
    seed = block_size + gqa
    model, shard = tiny_drafter(seed, block_size=block_size, gqa=gqa), random_shard(seed, doc_lens=doc_lens)
    if shard_case == "two-token documents":
        shard["loss_mask"][: sum(doc_lens)] = 1  # every position trained: the 2-token documents' anchors are valid
    gamma = 3.0
    gen = torch.Generator().manual_seed(seed)
    out = drafter_loss(model, **shard, num_anchors=num_anchors, gamma=gamma, labels_from=labels_from, ce_chunk=7,
                       generator=gen)
    out.loss.backward()
    fast = grads(model)
    model.zero_grad()
    ref, correct, count = naive_loss(model, **shard, anchors=out.anchors, gamma=gamma, labels_from=labels_from)
    ref.backward()
    slow = grads(model)
    assert out.anchor_ok.sum() >= 8, "the test must exercise real anchors"
    if shard_case == "more anchors than valid positions":
        assert not out.anchor_ok.all(), "some anchor slots must stay unused"
    if shard_case == "two-token documents":
        assert {0, 2, 34}.issubset(out.anchors[out.anchor_ok].tolist()), "each 2-token document has one anchor"
    assert rel_err(out.loss.detach(), ref.detach()) < 1e-5
    for name in fast:
        assert rel_err(fast[name], slow[name]) < 1e-4, name
    assert torch.equal(out.slot_correct, correct) and torch.equal(out.slot_count, count)


# document lengths 30, 25, 20: windows as short as the block (shorter than every document), equal to one
# document, longer than all
@pytest.mark.parametrize("causal", [False, True], ids=["whole block", "causal block"])
@pytest.mark.parametrize("window", ["block", 25, 200, None])
@pytest.mark.parametrize("loss", ["decay", "dpace"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_dpace_and_sliding_window_match_the_naive_reference(block_size, loss, window, causal):
    """D-PACE's weights (from the rows' own cross-entropies, without gradient), the sliding window over
    the context (measured from each slot) and a causal block give the plain formula's loss and gradients."""
    window = block_size if window == "block" else window
    seed = block_size + (window or 0) + causal
    model = tiny_drafter(seed, block_size=block_size, sliding_window=window, causal_block=causal)
    shard = random_shard(seed)
    kw = dict(gamma=3.0, loss=loss, dpace_alpha=0.3, labels_from="target")
    out = drafter_loss(model, **shard, num_anchors=24, ce_chunk=7, generator=torch.Generator().manual_seed(seed),
                       **kw)
    out.loss.backward()
    fast = grads(model)
    model.zero_grad()
    ref, correct, count = naive_loss(model, **shard, anchors=out.anchors, **kw)
    ref.backward()
    assert out.anchor_ok.sum() >= 16
    assert rel_err(out.loss.detach(), ref.detach()) < 1e-5
    slow = grads(model)
    for name in fast:
        assert rel_err(fast[name], slow[name]) < 1e-4, name
    assert torch.equal(out.slot_correct, correct) and torch.equal(out.slot_count, count)


def min_cut_backend(saved_bytes: list):
    """A torch.compile backend with AOT autograd's min-cut partitioner (the one Inductor uses, which honours the
    activation memory budget and checkpointed regions) and eager kernels, without Inductor's C++ compile; it
    records the bytes each forward graph hands on (its outputs: what the backward keeps, and the results)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, example_inputs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        values = [getattr(v, "meta", {}).get("val") for v in outputs]
        saved_bytes.append(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        partition_fn=min_cut_rematerialization_partition)


@pytest.mark.parametrize("recompute", ["none", "mlp", "attention", "layers"])
def test_recomputation_and_the_activation_budget_keep_the_loss_and_gradients(recompute):
    """Recomputing a part of every layer in the backward (eager and compiled) and the compiled step's activation
    memory budget change what the forward keeps, never the loss or the gradients: each matches the naive
    reference; a budget below 1 keeps less, and recomputing whole layers keeps less than recomputing nothing."""
    model, shard = tiny_drafter(6), random_shard(6)
    anchors = torch.tensor([1, 5, 12, 33, 40, 57, 61, 70])
    ref, _, _ = naive_loss(model, **shard, anchors=anchors, gamma=4.0)
    ref.backward()
    slow = grads(model)

    def step(what):
        model.zero_grad(set_to_none=True)
        loss = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, anchors=anchors, ce_chunk=7, recompute=what).loss
        loss.backward()
        return loss.detach(), grads(model)

    runs = {"eager": step(recompute)}
    saved = {}
    baseline = [("none", 1.0)] if recompute == "layers" else []  # what whole layers recomputed keep less than
    for what, budget in [(recompute, 1.0), (recompute, 0.3)] + baseline:
        torch._dynamo.reset()
        saved[what, budget] = []
        with torch._functorch.config.patch(activation_memory_budget=budget):
            runs[what, budget] = torch.compile(step, backend=min_cut_backend(saved[what, budget]))(what)
    for name, (loss, fast) in runs.items():
        assert rel_err(loss, ref.detach()) < 1e-5, name
        assert all(rel_err(fast[n], slow[n]) < 1e-4 for n in slow), name
    kept = {k: v[0] for k, v in saved.items()}  # the step's forward graph (then the cross-entropy chunk's)
    assert kept[recompute, 0.3] <= kept[recompute, 1.0]
    if recompute == "none":
        assert kept["none", 0.3] < 0.8 * kept["none", 1.0]
    if recompute == "layers":
        assert kept["layers", 1.0] < 0.8 * kept["none", 1.0]


def test_a_window_changes_the_loss_only_where_it_cuts_the_context():
    """The window is measured from each slot: W = 30 cuts the first token of a 30-token document for the
    late slots of its late anchors; a window past every slot's position (30 + B) is full attention."""
    shard, anchors = random_shard(5), torch.tensor([3, 12, 28, 33, 50, 57, 70, 72])
    losses = {w: drafter_loss(tiny_drafter(5, sliding_window=w), **shard, num_anchors=8, anchors=anchors).loss
              for w in (None, 30 + B, 30, B)}
    assert losses[30 + B].item() == pytest.approx(losses[None].item(), rel=1e-6)
    assert losses[30].item() != pytest.approx(losses[None].item(), rel=1e-6)
    assert abs(losses[B].item() - losses[None].item()) > 1e-3


def test_dpace_weights_follow_the_formula():
    ce = torch.tensor([[0.1, 2.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    supervised = torch.tensor([[True, True, False, True], [True, True, True, True]])
    w = dpace_weights(ce, supervised, alpha=0.5)
    for row in range(2):
        expected = dpace_slot_weights([x if s else None for x, s in zip(ce[row].tolist(), supervised[row])], 0.5)
        torch.testing.assert_close(w[row], torch.tensor(expected))
    q = 0.5 * torch.exp(-torch.tensor(1.0)) + 0.5  # row 1: C_j = q^j, w_j = sum over m >= j of q^m
    torch.testing.assert_close(w[1], torch.stack([sum(q ** m for m in range(j, 5)) for j in range(1, 5)]))
    # row 0: slot 3 has no label: q~ = 1 in the product (slot 4 keeps C_2), weight 0
    q0 = 0.5 * torch.exp(-ce[0]) + 0.5
    c1, c2 = q0[0], q0[0] * q0[1]
    c4 = c2 * q0[3]
    torch.testing.assert_close(w[0], torch.stack([c1 + c2 + c2 + c4, c2 + c2 + c4, torch.tensor(0.0), c4]))
    assert torch.allclose(dpace_weights(ce, supervised, alpha=1.0)[1], torch.tensor([4.0, 3.0, 2.0, 1.0]))


def test_packing_is_invisible():
    """A document's loss is the same alone at offset 0 as packed behind others."""
    model = tiny_drafter(3)
    packed = random_shard(3, doc_lens=(30, 25, 20))
    alone = {k: v.clone() for k, v in packed.items()}
    start, n = 55, 20  # the third document
    for key in ("hidden", "input_ids", "loss_mask", "target_ids"):
        alone[key].zero_()
        alone[key][:n] = packed[key][start:start + n]
    alone["doc_lens"] = torch.tensor([n, 0, 0, 0, 0, 0], dtype=torch.int32)
    anchors = torch.tensor([2, 5, 9, 13])
    a = drafter_loss(model, **alone, num_anchors=4, gamma=4.0, anchors=anchors)
    b = drafter_loss(model, **packed, num_anchors=4, gamma=4.0, anchors=anchors + start)
    assert a.anchor_ok.all() == b.anchor_ok.all()
    assert rel_err(a.loss.detach(), b.loss.detach()) < 1e-5


@pytest.mark.parametrize("window, causal", [(None, False), (12, False), (12, True)])
def test_flex_attention_forward_matches_sdpa_on_cpu(window, causal):
    model = tiny_drafter(4, sliding_window=window, causal_block=causal)
    shard = random_shard(4, T=128, doc_lens=(60, 40))
    anchors = torch.tensor([3, 10, 20, 33, 50, 61, 70, 90])
    with torch.no_grad():
        a = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, anchors=anchors, attention="dense")
        b = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, anchors=anchors, attention="flex")
    assert rel_err(a.loss, b.loss) < 1e-5


@pytest.mark.parametrize("window, causal", [(None, False), (B, True), (20, False)])
def test_block_attention_matches_sdpa_with_the_dense_mask(window, causal):
    """The CPU path scores each query against its own block only: outputs and gradients equal dense SDPA."""
    lay = layout(torch.tensor([40, 30, 0], dtype=torch.int32), 80)
    anchors = torch.tensor([0, 5, 17, 39, 40, 52, 60, 68])  # 0 and 40 see no context: only their block
    A, T, nq, nkv, D = len(anchors), 80, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, m, D, generator=g, requires_grad=True)
               for n, m in ((nq, A * B), (nkv, T + A * B), (nkv, T + A * B)))
    grad_out = torch.randn(1, nq, A * B, D, generator=g)
    results = []
    for attend in (block_attention(context_mask(anchors, lay, B, window), B, causal),
                   sdpa_attention(dense_mask(anchors, lay, B, window, causal))):
        out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out, *grads))
    for fast, ref, name in zip(*results, ("out", "dq", "dk", "dv")):
        assert rel_err(fast, ref) < 1e-5, name


def test_layout_and_valid_anchors():
    lens = torch.tensor([3, 4, 0, 0], dtype=torch.int32)
    lay = layout(lens, 10)
    assert lay.doc_id.tolist() == [0, 0, 0, 1, 1, 1, 1, 4, 4, 4]
    assert lay.pos[:7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert lay.doc_end[:7].tolist() == [3, 3, 3, 7, 7, 7, 7] and lay.real.tolist() == [True] * 7 + [False] * 3
    mask = torch.tensor([1, 1, 1, 1, 0, 1, 1, 0, 0, 0], dtype=torch.uint8)
    # p valid: loss on p and p+1, p+1 inside p's document
    assert valid_anchors(lay, mask).tolist() == [True, True, False, False, False, True, False, False, False, False]


def test_anchor_sampling_is_uniform_over_valid_positions_and_fixed_size():
    valid = torch.zeros(50, dtype=torch.bool)
    valid[[3, 7, 8, 20, 21, 22, 40]] = True
    anchors, ok = sample_anchors(valid, 10, torch.Generator().manual_seed(0))
    assert anchors.shape == (10,) and torch.equal(anchors, anchors.sort().values)
    assert sorted(anchors[ok].tolist()) == [3, 7, 8, 20, 21, 22, 40] and ok.sum() == 7
    counts = torch.zeros(50)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        a, o = sample_anchors(valid, 3, gen)
        counts[a[o]] += 1
    freq = counts[valid] / 2000
    assert ((freq - 3 / 7).abs() < 0.05).all(), freq  # each valid position with probability A / valid


def test_anchor_sampling_leaves_no_sort_for_the_compiler():
    """Inductor compiles a sort of <= 512 elements into a Triton sorting network, slow to compile; the
    sampler keeps to topk, which stays one library call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda v: sample_anchors(v, 512))(torch.rand(4096) > 0.3)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("topk" in o for o in ops) and not any("sort" in o for o in ops), ops


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("T, doc_lens, A, block_size, window, causal", [
    (3072, (1000, 900, 700, 400), 64, 16, None, False),  # whole tiles
    (3072, (1000, 900, 700, 400), 64, 16, 300, False),  # a window shorter than the documents
    (3072, (1000, 900, 700, 400), 64, 16, 1000, True),  # as long as the longest; causal blocks
    (1000, (300, 2, 450, 200), 40, 10, None, False),  # T and A*B not multiples of 128; B does not divide 128
    (1000, (300, 2, 450, 200), 40, 10, 10, True),  # a window as short as the block
    (384, (384,), 24, 128, None, False),  # blocks as wide as a tile: full tiles inside a block
    (384, (384,), 24, 128, 200, True),
    (700, (50, 600), 7, 3, None, True),  # one query tile
])
def test_flex_block_mask_equals_create_block_mask(T, doc_lens, A, block_size, window, causal):
    """Every tensor of the BlockMask built from intervals equals torch's, built by evaluating the mask
    per element, so the kernels visit the same tiles in the same order."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(T)
    lay = layout(torch.tensor(doc_lens, dtype=torch.int32), T)
    valid = lay.real.clone()
    valid[torch.tensor(doc_lens).cumsum(0)[:-1]] = True  # anchors at document starts see no context
    anchors, _ = sample_anchors(valid, A, g)
    ours = flex_block_mask(anchors, lay, block_size, window, causal)
    theirs = create_block_mask(ours.mask_mod, 1, 1, A * block_size, T + A * block_size, device="cpu")
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for name in BLOCK_MASK_FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    dense = dense_mask(anchors, lay, block_size, window, causal)
    assert torch.equal(dense, torch.nn.attention.flex_attention.create_mask(ours.mask_mod, 1, 1, *dense.shape,
                                                                            device="cpu")[0, 0])
    ok = torch.rand(A, generator=g) > 0.2  # the FLOP count's keys: what the mask shows real anchors, a block others
    seen = dense.view(A, block_size, -1).sum((1, 2))
    own = block_size * (block_size + 1) // 2 if causal else block_size**2
    assert visible_keys(anchors, ok, lay, block_size, window, causal) == torch.where(ok, seen, own).sum()


def test_flex_block_mask_leaves_no_sort_or_scan_for_the_compiler():
    """Inductor turns torch's argsort of block indices into a Triton sorting network that takes minutes to
    compile, and a cumsum into a scan kernel that takes seconds; the builder counts with plain sums instead
    (and no scatter: Inductor on torch 2.11 fails to generate one of them at the 8B drafter's shape)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    lay = layout(torch.tensor([1500, 1572], dtype=torch.int32), 3072)
    gm = make_fx(lambda a: flex_block_mask(a, lay, 16).kv_indices)(torch.arange(512) * 6)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("sum" in o for o in ops) and not any(x in o for o in ops for x in ("sort", "scatter", "cumsum")), ops


def test_blocks_labels_and_weights():
    T = 12
    lens = torch.tensor([7, 5], dtype=torch.int32)
    lay = layout(lens, T)
    input_ids = torch.arange(100, 100 + T)
    target_ids = torch.arange(200, 200 + T)
    loss_mask = torch.ones(T, dtype=torch.uint8)
    loss_mask[9] = 0
    anchors, ok = torch.tensor([4, 8]), torch.tensor([True, True])
    b = make_blocks(anchors, ok, lay, input_ids, target_ids, loss_mask, block_size=4, mask_token_id=7,
                    labels_from="data")
    assert b.ids.tolist() == [104, 7, 7, 7, 108, 7, 7, 7]
    assert b.pos.tolist() == [4, 5, 6, 7, 1, 2, 3, 4]  # positions restart in every document
    assert b.labels.tolist() == [[105, 106, 107], [109, 110, 111]]
    w = torch.exp(-torch.arange(3) / 2.0)
    # anchor 4: slots 1, 2 inside document 0 (ends at 7), slot 3 past its end; anchor 8: slot 1 has no loss
    assert b.supervised.tolist() == [[True, True, False], [False, True, True]]
    torch.testing.assert_close(decay_weights(b.supervised, 2.0),
                               torch.stack([w * torch.tensor([1, 1, 0]), w * torch.tensor([0, 1, 1])]))
    t = make_blocks(anchors, ok, lay, input_ids, target_ids, loss_mask, block_size=4, mask_token_id=7,
                    labels_from="target")
    assert t.labels.tolist() == [[204, 205, 206], [208, 209, 210]]  # target_ids[t-1] predicts token t
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4


@pytest.mark.parametrize("weighting", ["fixed", "from the rows' CE"])
def test_chunked_head_cross_entropy_matches_full_logits(weighting):
    """Weights that are constants or computed from the rows' own CE (D-PACE's kind, without gradient) scale
    the per-row gradients exactly as a full-logits loss with the same detached weights does."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 32, generator=g, requires_grad=True)
    W = torch.randn(500, 32, generator=g)
    y = torch.randint(0, 500, (37,), generator=g)
    fixed = torch.rand(37, generator=g)
    weigh = (lambda ce: fixed) if weighting == "fixed" else (lambda ce: torch.exp(-ce) + 0.1)
    total, w, correct, _ = head_cross_entropy(h, W, y, weigh, chunk=8)
    total.backward()
    h2 = h.detach().clone().requires_grad_()
    logits = h2 @ W.t()
    ce = F.cross_entropy(logits, y, reduction="none")
    ref = (weigh(ce.detach()) * ce).sum()
    ref.backward()
    assert rel_err(total.detach(), ref.detach()) < 1e-6 and rel_err(h.grad, h2.grad) < 1e-5
    assert rel_err(w, weigh(ce.detach())) < 1e-6 and torch.equal(correct, logits.argmax(-1) == y)


@pytest.mark.parametrize("vocab_size,rows", [(151936, 2048), (128256, 2048), (262144, 1024), (4096, 65536)])
def test_the_default_cross_entropy_chunk_is_the_most_rows_whose_logits_fit_the_budget(vocab_size, rows):
    budget = 5 << 28
    assert ce_rows(vocab_size) == rows and rows & (rows - 1) == 0
    assert rows * vocab_size * 4 <= budget < 2 * rows * vocab_size * 4
    assert ce_rows(budget) == 1  # a vocabulary too large for the budget still gets rows of one


def test_chunked_cross_entropy_compiled_as_one_region_matches_eager():
    """A compiled step can run the chunk as one nested compile region called per chunk (including a shorter
    last chunk) instead of unrolled copies: the same loss, argmax and gradient as eagerly."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    W, y = torch.randn(64, 16, generator=g), torch.randint(0, 64, (37,), generator=g)
    weigh = lambda ce: torch.exp(-ce)  # noqa: E731
    total, _, correct, _ = head_cross_entropy(h, W, y, weigh, chunk=8)
    total.backward()
    h2 = h.detach().clone().requires_grad_()
    compiled = torch.compile(lambda *a: head_cross_entropy(*a, weigh, chunk=8, region=True), backend="aot_eager")
    total2, _, correct2, _ = compiled(h2, W, y)
    total2.backward()
    assert rel_err(total2.detach(), total.detach()) < 1e-6 and rel_err(h2.grad, h.grad) < 1e-6
    assert torch.equal(correct2, correct)


def test_compiled_step_reads_rope_from_the_cached_tables():
    """After `cache_rope`, a compiled step looks RoPE up (no sin or cos left for Inductor to recompute in
    every kernel) with the loss and gradients of the eager step; eagerly RoPE is still computed, for any
    position (decoding goes past the tables)."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    shard, anchors = random_shard(seed=4), torch.tensor([1, 5, 12, 33, 40, 57, 61, 70])
    model = tiny_drafter(seed=4)

    def step():
        model.zero_grad(set_to_none=True)
        loss = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, attention="dense", anchors=anchors).loss
        loss.backward()
        return loss.detach(), grads(model)

    ref_loss, ref = step()
    model.cache_rope(96 + B)
    torch._dynamo.reset()
    loss, got = torch.compile(step, backend=recording_backend)()
    assert rel_err(loss, ref_loss) < 1e-6 and all(rel_err(got[n], ref[n]) < 1e-5 for n in ref)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert ops and not any("sin" in o or "cos" in o for o in ops), ops
    far = torch.tensor([0, 96 + B + 50])
    assert all(torch.equal(a, b) for a, b in zip(model.rope(far), rope_tables(far, 16, 10000.0)))


def test_replay_cycles_follows_decoding_order():
    from dflash.evaluate import replay_cycles

    # doc 0 = positions 0-5, doc 1 = 6-9; -1: no valid anchor there (prompt, user turn, last token)
    accepted_at = torch.tensor([-1, 2, 0, 5, 1, 0, -1, 3, 0, 0])
    doc_end = torch.tensor([6] * 6 + [10] * 4)
    # doc 0: first anchor 1 accepts 2 -> next cycle at 4 accepts 1 -> 6 is doc 1's; doc 1: 7 accepts 3 -> end
    assert replay_cycles(accepted_at, doc_end) == [[2, 1], [3]]


def test_tau_pooled_and_per_request():
    from dflash.evaluate import per_request_tau

    # request 1: 3 verify steps, 6 accepted -> 3.0; request 2: one step, 0 accepted -> 1.0
    requests = [[2, 1, 3], [0], []]
    assert per_request_tau(requests) == pytest.approx(2.0)
    pooled = 1 + sum(map(sum, requests)) / sum(map(len, requests))
    assert pooled == pytest.approx(2.5)


def test_the_walk_over_every_anchor_is_decoding_order_and_over_sampled_anchors_skips_ahead():
    """SpecForge's walk visits the next sampled anchor at or past where decoding would resume; over every
    anchor it is exactly the replay in decoding order (eval's pooled tau)."""
    from dflash.evaluate import replay_cycles, walk_tau

    g = torch.Generator().manual_seed(0)
    ends = torch.tensor([40, 75, 120])
    T = 120
    doc = (torch.arange(T)[:, None] >= ends[None, :]).sum(1)
    doc_end = ends[doc]
    valid = (torch.rand(T, generator=g) > 0.2) & (torch.arange(T) + 1 < doc_end)
    acc = torch.randint(0, 6, (T,), generator=g)
    acc = torch.minimum(acc, doc_end - torch.arange(T) - 2).clamp(min=0)  # drafts stay inside the document
    accepted_at = torch.where(valid, acc, -1)
    steps = [a for d in replay_cycles(accepted_at, doc_end) for a in d]
    total, visits = walk_tau(list(range(T)), valid.tolist(), doc.tolist(), acc.tolist())
    assert (total, visits) == (sum(steps) + len(steps), len(steps))
    # sampled anchors 2, 5, 9 of one document, accepting 4, 1, 0: visit 2 (resume at 7), skip 5, visit 9
    assert walk_tau([2, 5, 9], [True, True, True], [0, 0, 0], [4, 1, 0]) == (5 + 1, 2)
    # an unused anchor slot is never visited; each document starts its own walk
    assert walk_tau([1, 3, 50, 52], [True, False, True, True], [0, 0, 1, 1], [5, 0, 0, 0]) == (6 + 1 + 1, 3)
