#!/usr/bin/env python
"""Build the code rows of `data/sample/`: function headers (signature + docstring) from the Python
standard library, split exactly as the tiny target's training split its files.

- `code.jsonl`: `{"text", "source"}` headers from the target's *training* files; `dflash regenerate
  --prompt-tokens 100000` has the target write each body (what the drafter trains on).
- `code_prompts.jsonl`: headers from the target's *held-out* files (never seen by the target or the
  drafter): the prompts of `dflash spec` for issue 4's quality figures.

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


def headers(path: Path, root: Path) -> list[dict]:
    """Every function or method with a docstring and a body: its source up to the end of the docstring."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, OSError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        if node.end_lineno - doc.end_lineno < MIN_BODY_LINES:
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        # ends at the docstring's closing quotes, no newline: the tokenizer merges a newline with the next
        # line's indent, so a bare trailing newline would tell the target that the function has ended
        text = textwrap.dedent("\n".join(lines[start - 1 : doc.end_lineno]))
        if MIN_HEADER <= len(text) <= MAX_HEADER:
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
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
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
