"""The family matrix: for every target family users train drafters for, a tiny random model goes through
extract -> train -> eval -> export -> spec. Its cached states are those the target computes for each
document alone, prefix-invariant (a document's first k tokens get the states of the document cut to k
tokens, and of decoding it one token at a time: what the target computes while serving), and
speculative decoding is lossless."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import REPO, bf16_bits_to_float, read_arrays, rel_err, run_in_process, sample_rows, write_jsonl
from dflash.families import make_exact
from dflash.target import cache_argument
from families import FAMILIES, HYBRIDS, MASK_ID, MOE, tiny_target

LAYERS = [0, 2, 3]  # the last one (3) is HF's hidden_states[4]: after the final norm
MAX_LEN = 96  # documents are truncated to this: longer than every window (16) and indexer top-k (16)
TOL = 5e-3  # the cache holds bf16: relative rounding <= 2^-9 per value


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("families") / "d.jsonl", sample_rows(6, 6))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rows = [json.loads(x) for x in (REPO / "data" / "sample" / "code_prompts.jsonl").read_text().splitlines()[:2]]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "p.jsonl", rows)


def cached_documents(cache):
    """(input ids [n], hidden [n, L, H] fp32, target ids [n]) of every document in the cache."""
    a = read_arrays(cache)
    for s in range(a["doc_lens"].shape[0]):
        offset = 0
        for n in a["doc_lens"][s]:
            if n == 0:
                continue
            sl = slice(offset, offset + n)
            yield (torch.from_numpy(a["input_ids"][s, sl].astype(np.int64)), bf16_bits_to_float(a["hidden"][s, sl]),
                   torch.from_numpy(a["target_ids"][s, sl].astype(np.int64)))
            offset += n


def states(model, ids: torch.Tensor) -> torch.Tensor:
    """[n, L, H]: the captured layers for `ids` alone, from HF's output_hidden_states."""
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[i + 1][0] for i in LAYERS], 1)


def decoded_states(model, ids: torch.Tensor) -> torch.Tensor:
    """[n, L, H]: the same layers while decoding `ids` one token at a time through the KV cache."""
    cache, rows = DynamicCache(config=model.config), []
    name = cache_argument(model.forward)
    with torch.no_grad():
        for t in range(len(ids)):
            out = model(ids[None, t : t + 1], **{name: cache}, use_cache=True, output_hidden_states=True)
            rows.append(torch.stack([out.hidden_states[i + 1][0, 0] for i in LAYERS]))
    return torch.stack(rows)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_end_to_end(tmp_path, data, prompts, model_type):
    target = tiny_target(model_type, tmp_path / "target")
    cache, run, export = tmp_path / "cache", tmp_path / "run", tmp_path / "export"
    r = run_in_process(["extract", "--target", str(target), "--data", str(data), "--out", str(cache), "--device", "cpu",
                        "--layers", ",".join(map(str, LAYERS)), "--token-budget", "256", "--max-docs", "8",
                        "--max-len", str(MAX_LEN), "--batch-size", "4", "--batch-tokens", "512", "--window", "2"])
    assert r.exit_code == 0, r.output
    if model_type in HYBRIDS:
        assert "linear-attention layers run on the torch path" in r.output
    assert ("MoE experts: grouped_mm" in r.output) == (model_type in MOE), r.output

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    make_exact(model)  # as dflash loads it (a causal top-k for GLM-5's indexer)
    docs = list(cached_documents(cache))
    assert len(docs) == 12 and all(len(ids) > 16 for ids, _, _ in docs)
    for k, (ids, hidden, target_ids) in enumerate(docs):
        alone = states(model, ids)
        assert rel_err(hidden, alone) < TOL, f"document {k}: cache vs the document alone"
        cut = len(ids) * 2 // 3
        assert rel_err(hidden[:cut], states(model, ids[:cut])) < TOL, f"document {k}: not prefix-invariant"
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
        top2 = logits.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 1e-4  # a near-tie may flip between batch shapes
        assert torch.equal(target_ids[clear], logits.argmax(-1)[clear]), f"document {k}: target_ids"
    ids, hidden, _ = docs[0]
    assert rel_err(hidden, decoded_states(model, ids)) < TOL, "cache vs decoding one token at a time"

    r = run_in_process(["train", "--cache", str(cache), "--out", str(run), "--device", "cpu", "--num-layers", "1",
                        "--layers", "0,2",  # the last layer is cached after the final norm: servers read it before
                        "--block-size", "8", "--num-anchors", "16", "--max-steps", "2", "--holdout-shards", "1",
                        "--mask-token-id", str(MASK_ID)])
    assert r.exit_code == 0, r.output
    r = run_in_process(["eval", "--drafter", str(run), "--cache", str(cache), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tau"] >= 1.0  # stdout holds the JSON alone; notes go to stderr
    assert run_in_process(["export", str(run), "--out", str(export)]).exit_code == 0
    r = run_in_process(["spec", "--target", str(target), "--drafter", str(export), "--prompts", str(prompts),
                        "--max-new-tokens", "24", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["lossless"] is True and result["prompts"] == 2, result


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_spec_rewinds_every_family(tmp_path, model_type):
    """Drafts right for `right` slots then wrong: every cycle rejects some (or, at right = B-1, none) of the
    block, so the target's cache is rewound mid-block (recurrent states of the hybrids included)."""
    from dflash.spec import records_recurrent_states, speculative_greedy, target_greedy
    from dflash.target import Target
    from test_spec import B, OracleDrafter

    model = AutoModelForCausalLM.from_pretrained(tiny_target(model_type, tmp_path / "t"), dtype=torch.float32).eval()
    make_exact(model)
    target = Target(model, LAYERS)
    native = records_recurrent_states()
    torch.manual_seed(0)
    for right in (2, B - 1):
        for n in (5, 40):  # a prompt shorter than the convolution / window / top-k, and one longer
            prompt = torch.randint(10, model.config.vocab_size, (n,)).tolist()
            answer = target_greedy(target, prompt, 30, set())
            oracle = OracleDrafter(target, prompt, answer, right)
            stats = {}
            tokens, accepted = speculative_greedy(target, oracle, prompt, 30, set(), stats)
            assert tokens == answer, (right, n)
            assert all(a == right for a in accepted[:-1]), accepted
            if model_type not in HYBRIDS or native:  # only linear attention is rolled back by replaying,
                assert stats["replay_s"] == 0, stats  # and only where transformers cannot restore its state
            elif right < B - 1:
                assert stats["replay_s"] > 0, stats


def test_device_map_capture_equals_one_device(tmp_path, data):
    """--device-map: the target's layers split over devices by accelerate's hooks (on CPU: the middle
    layers offloaded to disk and streamed in at each forward) give exactly the cache of an unsplit target,
    captured layers gathered whatever device they sit on."""
    target = tiny_target("qwen3", tmp_path / "target")
    common = ["--target", str(target), "--data", str(data), "--device", "cpu", "--layers", "0,1,3",
              "--token-budget", "256", "--max-docs", "8", "--max-len", str(MAX_LEN)]
    split = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
             "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    r = run_in_process(["extract", *common, "--out", str(tmp_path / "split"), "--device-map", json.dumps(split)])
    assert r.exit_code == 0, r.output
    assert "the target's layers on cpu, disk" in r.output
    assert run_in_process(["extract", *common, "--out", str(tmp_path / "one")]).exit_code == 0
    a, b = read_arrays(tmp_path / "split"), read_arrays(tmp_path / "one")
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("value,message", [("nowhere", "not a strategy"), ("[1, 2]", "must be an object"),
                                           ('{"lm_head": "disk", "model": "cpu"}', "offloaded to disk")])
def test_device_map_errors_are_one_line(tmp_path, data, value, message):
    target = tiny_target("qwen3", tmp_path / "target")
    r = run_in_process(["extract", "--target", str(target), "--data", str(data), "--device", "cpu", "--layers", "0,1",
                        "--out", str(tmp_path / "c"), "--device-map", value])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output, r.output


def test_fla_kernels_lose_the_shape_sizes_of_their_autotuning_keys(monkeypatch):
    """fla re-autotuned l2norm for every forward size and cumsum for every row count (9 s and 0.8 s each
    on an H200): those sizes leave the keys, under triton.heuristics wrappers too; other keys stay."""
    import sys
    import types

    from dflash.families import tune_fla_once

    l2norm = types.SimpleNamespace(keys=["D", "NB"])
    cumsum = types.SimpleNamespace(keys=["B", "H", "BT"])
    monkeypatch.setitem(sys.modules, "fla.modules.norm.l2norm", types.SimpleNamespace(l2norm_fwd_kernel=l2norm))
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cumsum", types.SimpleNamespace(
        chunk_local_cumsum_scalar_kernel=types.SimpleNamespace(fn=cumsum)))  # a Heuristics around the Autotuner
    assert tune_fla_once() == 2
    assert l2norm.keys == ["D"] and cumsum.keys == ["H", "BT"]
    assert tune_fla_once() == 0  # already done


def test_causal_topk_keeps_the_best_causal_keys_earliest_first_on_ties():
    """causal_topk on ReLU'd scores with planted exact ties (zeros and a few repeated levels), causal
    and padded: each query's first min(k, allowed) picks are its allowed keys ranked by score, the
    earlier key first among equal scores, and the rest are disallowed keys; cutting the sequence after
    n tokens leaves the picks of the first n queries unchanged (prefix-invariant)."""
    from dflash.families import causal_topk

    g = torch.Generator().manual_seed(0)
    B, S, k = 3, 48, 8
    boundary_ties = 0
    for _ in range(10):
        levels = torch.relu(torch.randint(-3, 4, (B, S, S), generator=g).float()) * 0.25  # many exact ties
        scores = torch.where(torch.rand(B, S, S, generator=g) < 0.3, torch.relu(torch.randn(B, S, S, generator=g)),
                             levels)
        pad = torch.rand(B, 1, S, generator=g) < 0.1  # padded keys, never selectable
        allowed = torch.ones(S, S, dtype=torch.bool).tril() & ~pad
        picks = causal_topk(scores, allowed, k)
        assert picks.shape == (B, S, k) and picks.dtype == torch.int32
        n = S * 2 // 3
        cut = causal_topk(scores[:, :n, :n], allowed[:, :n, :n], k)
        for b in range(B):
            for q in range(S):
                keys = [j for j in range(S) if allowed[b, q, j]]
                ranked = sorted(keys, key=lambda j: (-scores[b, q, j].item(), j))  # the rule, written out
                m = min(k, len(keys))
                got = picks[b, q].tolist()
                assert got[:m] == ranked[:m], (b, q)
                assert not any(allowed[b, q, j] for j in got[m:]), (b, q)
                if q < n:
                    assert cut[b, q, :m].tolist() == ranked[:m], (b, q)
                if len(keys) > k and scores[b, q, ranked[k - 1]] == scores[b, q, ranked[k]]:
                    boundary_ties += 1
    assert boundary_ties > 100  # the tie rule decided the selection in many rows
