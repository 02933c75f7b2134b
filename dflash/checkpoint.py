"""Checkpoints of a training run: safetensors and JSON only (no pickles).

    RUN/config.json                      the run's self-describing config (train + drafter + cache key)
    RUN/checkpoints/step-00000120/       model.safetensors, optimizer.safetensors, rng.safetensors,
                                         state.json (step, data cursor, optimizer hyperparameters)
    RUN/checkpoints/latest.json          {"step": 120, "dir": "step-00000120"}, replaced atomically last
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from dflash.errors import DflashError
from dflash.files import load_tensors, save_tensors, write_json_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"


def _optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict) -> tuple[dict, list]:
    """AdamW's state as flat named tensors, plus its param groups (JSON)."""
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"{names[idx]}::{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    # a tensor lr (CUDA: changing it never recompiles) is stored as its value
    groups = [{k: v.item() if torch.is_tensor(v) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def save(run: Path, step: int, model: torch.nn.Module, optimizer, state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` (whole or not at all: `latest.json` moves last), keep the newest `keep`.
    A write that fails (a full disk) leaves the last good checkpoint as it was, and no partial folder."""
    root = run / CHECKPOINTS
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, model, optimizer, state, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_json_atomic(root / LATEST, {"step": step, "dir": final.name})
    older = sorted(p for p in root.glob("step-*") if p != final)
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(tmp: Path, model: torch.nn.Module, optimizer, state: dict, step: int) -> None:
    params = dict(model.named_parameters())
    save_tensors({k: v.detach().contiguous().cpu() for k, v in params.items()}, tmp / "model.safetensors")
    index_names = {i: name for i, name in enumerate(params)}
    tensors, groups = _optimizer_tensors(optimizer, index_names)
    save_tensors({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_tensors(rng, tmp / "rng.safetensors")
    write_json_atomic(tmp / "state.json", {**state, "step": step, "param_groups": groups,
                                           "param_names": list(params)})


FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
_STEP_DIR = re.compile(r"step-\d{8}")


def latest(run: Path) -> Path | None:
    """The newest complete checkpoint: the one latest.json names (a folder of this run's checkpoints/, never
    a path leading elsewhere), or, if that file is lost, torn or names something else, the newest step folder
    that holds all its files (a run never restarts silently from step 0)."""
    found = candidates(run)
    return found[0] if found else None


def candidates(run: Path) -> list[Path]:
    """This run's checkpoints, newest first: the one latest.json names, then the complete step folders."""
    root = run / CHECKPOINTS
    named = None
    try:
        info = json.loads((root / LATEST).read_text())
        if isinstance(info, dict) and isinstance(info.get("dir"), str) and _STEP_DIR.fullmatch(info["dir"]) \
                and (root / info["dir"]).is_dir():
            named = root / info["dir"]
    except (OSError, ValueError):
        pass
    complete = [p for p in sorted(root.glob("step-*"), reverse=True)
                if _STEP_DIR.fullmatch(p.name) and all((p / f).is_file() for f in FILES)]
    return ([named] if named else []) + [p for p in complete if p != named]


def load(path: Path, model: torch.nn.Module, optimizer=None) -> dict:
    """Restore weights (and optimizer, RNG) from a checkpoint folder; returns its state.json. Every file is
    read and checked before anything is restored: a damaged checkpoint is one line and leaves the model as
    it was."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise DflashError(f"{path}: unreadable checkpoint ({e})") from None
    weights = load_weights(path)
    params = dict(model.named_parameters())
    missing = set(params) ^ set(weights)
    if missing:
        raise DflashError(f"{path}: checkpoint does not fit the drafter (parameters {sorted(missing)[:3]} ...)")
    shapes = [n for n, p in params.items() if weights[n].shape != p.shape]
    if shapes:
        raise DflashError(f"{path}: {shapes[0]} has shape {tuple(weights[shapes[0]].shape)}, the drafter's is "
                          f"{tuple(params[shapes[0]].shape)}")
    if optimizer is not None:
        tensors = load_tensors(path / "optimizer.safetensors", "checkpoint")
        rng = load_tensors(path / "rng.safetensors", "checkpoint")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    if optimizer is not None:
        names = state["param_names"]
        per_param: dict[int, dict] = {}
        for key, value in tensors.items():
            name, field = key.split("::")
            per_param.setdefault(names.index(name), {})[field] = value
        tensor_lrs = [g["lr"] for g in optimizer.param_groups]
        optimizer.load_state_dict({"state": per_param, "param_groups": _groups(optimizer, state["param_groups"])})
        for group, lr in zip(optimizer.param_groups, tensor_lrs):
            if torch.is_tensor(lr):  # back into the same tensor the step was built with
                group["lr"] = lr.fill_(float(group["lr"]))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # what a resumed optimizer takes from its checkpoint


def _groups(optimizer, saved: list[dict]) -> list[dict]:
    """The saved param groups as `optimizer` loads them: the saved hyperparameters, and the optimizer's own
    implementation flags (fused, foreach, AdamW's decoupled weight decay, ...), so that a checkpoint of torch's
    AdamW, fused on a GPU, resumes on a CPU or as `BF16AdamW`, and the other way round."""
    return [{**{k: v for k, v in own.items() if k != "params"}, **{k: g[k] for k in HYPERPARAMETERS if k in g},
             "params": g["params"]} for own, g in zip(optimizer.param_groups, saved)]


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_tensors(path / "model.safetensors", "checkpoint")
