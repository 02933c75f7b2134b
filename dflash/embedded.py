"""The embedded default: the tiny target, its trained drafter, the sample data and the tiny preset, found
wherever dflash runs from.

A wheel (`pip install .`) ships them as package data under `dflash/_embedded/` (pyproject.toml maps the
repository's `data/` and `configs/` there: one copy in git). A source checkout (`pip install -e .`, or the
checkout on PYTHONPATH) has them at the repository root. Both keep the same relative layout, so the
preset's `../data/...` paths (resolved against the preset's folder) hold in either.
"""

from __future__ import annotations

from pathlib import Path

from dflash.errors import DflashError

_PACKAGE = Path(__file__).resolve().parent

# Where to look, in order: the installed package data, then the checkout this module sits in.
ROOTS = (_PACKAGE / "_embedded", _PACKAGE.parent)

PRESET = "configs/tiny.toml"
TINY_TARGET = "data/tiny-target"
TINY_DRAFTER = "data/tiny-drafter"
SAMPLE = "data/sample"
HELD_OUT_PROMPTS = "data/sample/code_prompts.jsonl"

# Every file the demo reads (the preset's target and data included): what an installed wheel must hold.
FILES = (
    PRESET,
    *(f"{TINY_TARGET}/{f}" for f in ("config.json", "generation_config.json", "model.safetensors",
                                      "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")),
    *(f"{TINY_DRAFTER}/{f}" for f in ("config.json", "model.safetensors")),
    *(f"{SAMPLE}/generated/{f}" for f in ("text.jsonl", "code.jsonl")),
    HELD_OUT_PROMPTS,
)


def root() -> Path:
    """The folder holding `configs/` and `data/` of the embedded default (a DflashError if none is complete)."""
    for r in ROOTS:
        if all((r / f).is_file() for f in FILES):
            return r
    missing = sorted({f for r in ROOTS for f in FILES if not (r / f).is_file()})
    raise DflashError(f"the embedded tiny target, drafter and sample data are not installed (looked in "
                      f"{', '.join(map(str, ROOTS))}; missing e.g. {missing[0]}): reinstall dflash "
                      f"(`pip install .` from a clone) or run from a source checkout")


def path(relative: str) -> Path:
    """An embedded file or folder, e.g. `path(TINY_TARGET)`."""
    return root() / relative
