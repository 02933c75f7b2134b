"""`dflash plot RUN`: the loss and tau curves of a run, from RUN/metrics.jsonl, to a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import DflashError


def plot(run: str | Path, out: str | Path | None = None) -> Path:
    run = Path(run)
    try:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        raise DflashError(f"{run}: no metrics.jsonl (not a training run, or no step logged yet)") from None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DflashError("dflash plot needs matplotlib (pip install 'dflash[plot]')") from None
    loss = [(x["step"], x["loss"]) for x in lines if "loss" in x]
    tau = [(x["step"], x["tau"]) for x in lines if "tau" in x]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    if loss:
        ax[0].plot(*zip(*loss), lw=1)
    ax[0].set(title="training loss", xlabel="step", ylabel="weighted cross-entropy")
    if tau:
        ax[1].plot(*zip(*tau), marker="o")
    ax[1].set(title="acceptance length tau (held-out shards)", xlabel="step", ylabel="tau")
    for a in ax:
        a.grid(alpha=0.3)
    fig.suptitle(run.name)
    fig.tight_layout()
    out = Path(out) if out else run / "curves.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
