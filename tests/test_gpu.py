"""GPU checks (run on the H200; skipped on a machine without CUDA)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    REPO,
    bf16_bits_to_float,
    extract_args,
    read_arrays,
    rel_err,
    run_in_process,
    sample_rows,
    write_jsonl,
)
from families import tiny_target

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cpu_cache(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("cpu") / "c"
    assert run_in_process(extract_args(small_data, out)).exit_code == 0
    return out


@pytest.mark.parametrize("dtype,tol,agree", [("fp32", 4e-3, 0.99), ("bf16", 6e-2, 0.8)])
def test_gpu_extraction_matches_cpu(tmp_path, small_data, cpu_cache, dtype, tol, agree):
    out = tmp_path / "gpu"
    result = run_in_process(extract_args(small_data, out, device="cuda", dtype=dtype))
    assert result.exit_code == 0, result.output
    gpu, cpu = read_arrays(out), read_arrays(cpu_cache)
    for name in ("input_ids", "loss_mask", "doc_lens", "row_ids"):
        assert np.array_equal(gpu[name], cpu[name]), name  # same plan, same tokens
    used = cpu["input_ids"] != 0
    assert rel_err(bf16_bits_to_float(gpu["hidden"]), bf16_bits_to_float(cpu["hidden"])) < tol
    assert (gpu["target_ids"][used] == cpu["target_ids"][used]).mean() > agree


def test_gated_deltanet_fla_path_agrees_with_the_torch_path(tmp_path):
    """With flash-linear-attention installed, a Qwen3-Next target runs its GatedDeltaNet layers through
    fla on the GPU; the states agree with transformers' torch path (a process without fla, CPU, fp32)."""
    if importlib.util.find_spec("fla") is None:
        pytest.fail("flash-linear-attention is not installed: this check needs it (see bench/README.md)")
    import fla

    target = tiny_target("qwen3_next", tmp_path / "qwen3-next")
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(20, 20))
    gpu_out = tmp_path / "gpu"
    result = run_in_process(extract_args(data, gpu_out, target=target, layers="0,1,3", device="cuda"))
    assert result.exit_code == 0, result.output
    assert "linear-attention layers run on the fla path" in result.output
    # the torch path: a subprocess whose PYTHONPATH leaves out the folder fla lives in
    fla_root = str(Path(fla.__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(fla_root)]
    cpu_out = tmp_path / "cpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [str(REPO)]), "TOKENIZERS_PARALLELISM": "false"}
    check = subprocess.run([sys.executable, "-c", "import fla"], env=env, capture_output=True)
    assert check.returncode != 0, f"fla must live in its own folder on PYTHONPATH (found in {fla_root})"
    ref = subprocess.run([sys.executable, "-m", "dflash", *extract_args(data, cpu_out, target=target, layers="0,1,3")],
                         env=env, capture_output=True, text=True, cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert "run on the torch path" in ref.stdout + ref.stderr
    g, c = read_arrays(gpu_out), read_arrays(cpu_out)
    assert np.array_equal(g["input_ids"], c["input_ids"])
    for slot in range(3):
        assert rel_err(bf16_bits_to_float(g["hidden"][:, :, slot]), bf16_bits_to_float(c["hidden"][:, :, slot])) < 3e-2


def test_device_map_on_the_gpu_equals_one_device(tmp_path, small_data):
    """--device-map on the GPU: half the tiny target's layers mapped to the CPU (accelerate streams their
    weights to the GPU at each forward) writes the cache of the target on the GPU alone."""
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0,
             **{f"model.layers.{i}": (0 if i < 3 else "cpu") for i in range(6)}}
    one, mapped = tmp_path / "one", tmp_path / "mapped"
    assert run_in_process(extract_args(small_data, one, device="cuda")).exit_code == 0
    result = run_in_process(extract_args(small_data, mapped, device="cuda", device_map=json.dumps(split)))
    assert result.exit_code == 0, result.output
    a, b = read_arrays(one), read_arrays(mapped)
    for name in ("input_ids", "loss_mask", "doc_lens", "row_ids"):
        assert np.array_equal(a[name], b[name]), name
    assert rel_err(bf16_bits_to_float(b["hidden"]), bf16_bits_to_float(a["hidden"])) < 1e-2
    assert (a["target_ids"] == b["target_ids"]).mean() > 0.99


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_moe_default_experts_on_the_gpu_write_the_states_of_the_eager_loop(tmp_path, model_type):
    """An MoE target's default experts implementation (grouped_mm, one grouped matmul for all experts) writes
    the cache that transformers' eager loop over experts writes, on the GPU in bf16."""
    target = tiny_target(model_type, tmp_path / model_type)
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(20, 20))
    caches = {}
    for impl in ("auto", "eager"):
        result = run_in_process(extract_args(data, tmp_path / impl, target=target, layers="0,1,3", device="cuda",
                                             experts_implementation=impl))
        assert result.exit_code == 0, result.output
        assert f"MoE experts: {'grouped_mm' if impl == 'auto' else 'eager'}" in result.output
        caches[impl] = read_arrays(tmp_path / impl)
    fast, loop = caches["auto"], caches["eager"]
    assert np.array_equal(fast["input_ids"], loop["input_ids"])
    assert rel_err(bf16_bits_to_float(fast["hidden"]), bf16_bits_to_float(loop["hidden"])) < 2e-2
    used = loop["input_ids"] != 0
    assert (fast["target_ids"][used] == loop["target_ids"][used]).mean() > 0.9


def test_recompute_proves_a_gpu_cache_and_catches_another_target(tmp_path, small_data):
    """`cache verify --recompute` on the GPU: a bf16 cache extracted there matches its target rerun document by
    document (on the GPU, and in fp32 on the CPU within the default tolerance); a copy of the target with one
    layer changed is caught from that layer on."""
    import torch

    from test_recompute import target_copy

    out = tmp_path / "c"
    assert run_in_process(extract_args(small_data, out, device="cuda", layers="1,3,4")).exit_code == 0
    errors = {}
    for device, dtype in (("cuda", "auto"), ("cpu", "fp32")):
        result = run_in_process(["cache", "verify", str(out), "--recompute", "6", "--device", device, "--dtype", dtype,
                                 "--json"])
        assert result.exit_code == 0, result.output
        errors[device] = max(json.loads(result.stdout)["recompute"]["layers"].values())
    assert errors["cuda"] < 1e-2, errors  # bf16 again, each document alone instead of in a batch

    def change(model):
        with torch.no_grad():
            model.model.layers[2].mlp.down_proj.weight.mul_(1.5)

    other = target_copy(tmp_path / "t", change)
    result = run_in_process(["cache", "verify", str(out), "--recompute", "4", "--device", "cuda", "--target", other])
    assert result.exit_code == 1
    named = {line.split(", layer ")[1].split(":")[0] for line in result.stderr.splitlines() if ", layer " in line}
    assert named == {"3", "4"}, result.stderr
