#!/usr/bin/env python
"""Build the code rows of `data/sample/`: function headers (signature + docstring) from the Python
standard library, split exactly as the tiny target's training split its files.

- `code.jsonl`: `{"text", "source"}` headers from the target's *training* files; `dflash regenerate
  --prompt-tokens 100000` has the target write each body (what the drafter trains on).
- `code_prompts.jsonl`: headers from the target's *held-out* files (never seen by the target or the
  drafter): the prompts of `dflash spec` for the drafter quality figures.
- `--all FILE`: every function header of the training files (signature, and docstring where there is
  one; ~49 K rows): prompts for a large regeneration (`bench/quality_gpu.py`), not kept in the repo.

The tiny target is a code model (it never saw a chat), so code headers are the prompts on which its
greedy answers mean something. Deterministic for one Python build.

    python scripts/make_code_data.py [--out data/sample]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_target import HELD_OUT_EVERY, stdlib_files  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
N_CODE, N_PROMPTS = 600, 100
MIN_HEADER, MAX_HEADER = 120, 1500  # characters of signature + docstring
MIN_BODY_LINES = 4  # the function goes on after its docstring: there is something to write


def headers(path: Path, root: Path, every: bool = False) -> list[dict]:
    """Every function or method with a docstring and a body: its source up to the end of the docstring.
    `every`: also those without a docstring (up to the end of the signature), any size and body."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, OSError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        has_doc = ast.get_docstring(node) is not None
        if has_doc:
            end = node.body[0].end_lineno
        elif every:
            end = node.body[0].lineno - 1  # the signature's last line
        else:
            continue
        if node.end_lineno - end < (1 if every else MIN_BODY_LINES):
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        # ends at the docstring's closing quotes, no newline: the tokenizer merges a newline with the next
        # line's indent, so a bare trailing newline would tell the target that the function has ended
        text = textwrap.dedent("\n".join(lines[start - 1 : end]))
        if (0 if every else MIN_HEADER) <= len(text) <= MAX_HEADER and text.strip():
            out.append({"text": text, "source": f"{path.relative_to(root)}:{node.lineno}:{node.name}"})
    return out


def spread(items: list, n: int) -> list:
    """n items evenly spaced over the list (all of them if fewer)."""
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "data" / "sample")
    ap.add_argument("--all", type=Path, help="write every header of the training files here instead")
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    if args.all:
        rows = [h for i, p in enumerate(stdlib_files()) if i % HELD_OUT_EVERY for h in headers(p, root, every=True)]
        args.all.parent.mkdir(parents=True, exist_ok=True)
        args.all.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"{args.all}: {len(rows)} headers")
        return
    train, held = [], []
    for i, path in enumerate(stdlib_files()):
        (held if i % HELD_OUT_EVERY == 0 else train).extend(headers(path, root))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows, n in (("code.jsonl", train, N_CODE), ("code_prompts.jsonl", held, N_PROMPTS)):
        rows = spread(rows, n)
        with (args.out / name).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        print(f"{args.out / name}: {len(rows)} headers")


if __name__ == "__main__":
    main()
