#!/usr/bin/env python
"""Build `data/sample/`: a small dataset of real text, taken from the running Python's stdlib docs.

- `text.jsonl`: `{"text", "source"}` rows: the docstrings (>= 200 characters) of public stdlib
  modules and of the public classes they define, ordered by module name.
- `chat.jsonl`: `{"messages", "source"}` rows: assistant turns are the reference-manual topics of
  `pydoc_data.topics` (cut at a paragraph boundary to <= 3000 characters) and the docstrings of
  public stdlib functions; user turns are short templated questions. About one row in ten starts
  with a system message and about one in ten has two user/assistant exchanges.

Nothing here is written by us beyond the question templates: the text is CPython's own
documentation (PSF License). The output depends only on the Python build it runs on and is
deterministic: running it twice gives byte-identical files.

    python scripts/make_sample_data.py [--out data/sample] [--tokenizer data/tiny-target]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import warnings
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "data" / "sample"
DEFAULT_TOKENIZER = REPO / "data" / "tiny-target"

MIN_CHARS = 200
MAX_TEXT_CHARS = 6000  # text rows longer than this are cut at a paragraph boundary
MAX_TOPIC_CHARS = 3000  # pydoc topics are cut at a paragraph boundary to this
MAX_ANSWER_CHARS = 3000  # same for function docstrings
N_FUNCTION_ITEMS = 340  # function Q/A items kept (evenly spread over the sorted list)
N_PROMPTS = 100  # held-out questions about the other functions, in prompts.jsonl

# Never imported (import has side effects, needs a GUI, or is a test/demo/private-tooling package),
# at any depth of the module name.
SKIP = {
    "antigravity", "this", "turtle", "tkinter", "idlelib", "turtledemo",  # side effects / GUI
    "test", "tests", "lib2to3", "ensurepip", "pydoc_data",  # tests, tooling, data
    "readline", "rlcompleter",  # change the terminal's line editing when imported
    "distutils",  # setuptools may replace it: the text would depend on what is installed
    "site", "sitecustomize", "usercustomize",  # already run at startup
    "xxsubtype", "xxlimited", "xxlimited_35",  # CPython's test extension modules
    "encodings",  # hundreds of generated codec modules with boilerplate docstrings
}
# Packages whose submodules are documented as their own modules; others are top-level only.
WALK_PACKAGES = True

SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows the Python standard library well.",
    "You are an expert Python programmer. Answer with the official documentation.",
    "Answer questions about Python precisely, quoting the reference documentation.",
]
TOPIC_QUESTIONS = [
    'Explain the Python topic "{topic}".',
    'What does the Python documentation say about "{topic}"?',
    'Give me an overview of "{topic}" in Python.',
    'I need help with the Python topic "{topic}".',
]
TOPIC_FOLLOWUPS = [
    'Now explain "{topic}".',
    'And what about "{topic}"?',
]
FUNCTION_QUESTIONS = [
    "What does `{name}` do?",
    "Explain `{name}`.",
    "How do I use `{name}`?",
    "Describe the function `{short}` from the `{module}` module.",
]
FUNCTION_FOLLOWUPS = [
    "And `{name}`?",
    "What about `{name}`?",
]


def pick(options: list[str], key: str) -> str:
    """A stable choice (crc32, not the salted built-in hash)."""
    return options[zlib.crc32(key.encode()) % len(options)]


def normalise(doc: str) -> str:
    """Dedent (inspect.cleandoc), strip trailing spaces of lines, at most one blank line in a row."""
    text = inspect.cleandoc(doc.replace("\r\n", "\n"))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, cut at the last paragraph boundary (else line end) before it."""
    if len(text) <= limit:
        return text
    for sep in ("\n\n", "\n"):
        at = text.rfind(sep, 0, limit)
        if at >= MIN_CHARS:
            return text[:at].rstrip()
    return text[:limit].rstrip()


def skipped(name: str) -> bool:
    return any(part.startswith("_") or part in SKIP for part in name.split("."))


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def try_import(name: str):
    try:
        with quiet():
            return importlib.import_module(name)
    except BaseException:  # ImportError, platform-specific failures, SystemExit from odd modules
        return None


def stdlib_modules() -> list:
    """Public stdlib modules (and submodules of public packages) that import cleanly, by name."""
    mods: dict[str, object] = {}
    todo = sorted(n for n in sys.stdlib_module_names if not skipped(n))
    while todo:
        name = todo.pop(0)
        if name in mods:
            continue
        mod = try_import(name)
        if mod is None or getattr(mod, "__name__", None) != name:
            continue
        mods[name] = mod
        if WALK_PACKAGES and hasattr(mod, "__path__"):
            subs = sorted(f"{name}.{info.name}" for info in pkgutil.iter_modules(mod.__path__))
            todo = sorted(set(todo) | {s for s in subs if not skipped(s)})
    return [mods[n] for n in sorted(mods)]


def public_members(mod) -> list[tuple[str, object]]:
    """(name, object) of the public classes and functions the module itself defines, by name."""
    out = []
    with quiet():
        items = sorted(vars(mod).items())
    for key, obj in items:
        if key.startswith("_"):
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        out.append((key, obj))
    return out


def own_doc(obj) -> str | None:
    """The object's own docstring (not one inherited from a base class), normalised."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return normalise(doc) if isinstance(doc, str) else None


def collect(mods) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """text rows, and (module, qualified name, docstring) function items."""
    seen: set[str] = set()
    text_rows, functions = [], []
    for mod in mods:
        name = mod.__name__
        doc = normalise(mod.__doc__) if isinstance(mod.__doc__, str) else ""
        if len(doc) >= MIN_CHARS and doc not in seen:
            seen.add(doc)
            text_rows.append({"text": cut(doc, MAX_TEXT_CHARS), "source": name})
        for key, obj in public_members(mod):
            doc = own_doc(obj)
            if not doc or len(doc) < MIN_CHARS or doc in seen:
                continue
            seen.add(doc)
            if inspect.isclass(obj):
                text_rows.append({"text": cut(doc, MAX_TEXT_CHARS), "source": name})
            else:
                functions.append((name, f"{name}.{key}", cut(doc, MAX_ANSWER_CHARS)))
    return text_rows, functions


def spread(items: list, n: int) -> list:
    """`n` items evenly spaced over the list (all of them when there are fewer), order kept."""
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def chat_items() -> list[dict]:
    """One {source, key, question, followup, answer} per topic and kept function docstring."""
    from pydoc_data.topics import topics

    items = []
    for topic in sorted(topics):
        answer = cut(normalise(topics[topic]), MAX_TOPIC_CHARS)
        if len(answer) < MIN_CHARS:
            continue
        items.append({
            "source": "pydoc_data.topics",
            "question": pick(TOPIC_QUESTIONS, topic).format(topic=topic),
            "followup": pick(TOPIC_FOLLOWUPS, topic).format(topic=topic),
            "answer": answer,
        })
    return items


def function_items(functions) -> list[dict]:
    items = []
    for module, qualname, doc in functions:
        fmt = dict(name=qualname, short=qualname.rsplit(".", 1)[1], module=module)
        items.append({
            "source": module,
            "question": pick(FUNCTION_QUESTIONS, qualname).format(**fmt),
            "followup": pick(FUNCTION_FOLLOWUPS, qualname).format(**fmt),
            "answer": doc,
        })
    return items


def build_chat(items: list[dict]) -> list[dict]:
    """Rows of one exchange; row k % 10 == 3 gets a system message, and row k % 10 == 7 (or the next
    row after it whose item and the following one share a source) has two exchanges."""
    rows, i, want_multi = [], 0, False
    while i < len(items):
        k = len(rows)
        item = items[i]
        messages = []
        if k % 10 == 3:
            messages.append({"role": "system", "content": SYSTEM_PROMPTS[(k // 10) % len(SYSTEM_PROMPTS)]})
        messages += [{"role": "user", "content": item["question"]},
                     {"role": "assistant", "content": item["answer"]}]
        i += 1
        want_multi |= k % 10 == 7  # postponed to a later row until two neighbours share a source
        if want_multi and i < len(items) and items[i]["source"] == item["source"]:
            nxt = items[i]
            messages += [{"role": "user", "content": nxt["followup"]},
                         {"role": "assistant", "content": nxt["answer"]}]
            i += 1
            want_multi = False
        rows.append({"messages": messages, "source": item["source"]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


README = """\
# Sample data

Real text for examples, tests and smoke runs of `dflash`, not written for this project: the
documentation text of the CPython {py} standard library, read from the running interpreter
(Python Software Foundation License; see https://docs.python.org/3/license.html).

- `text.jsonl`, {n_text} rows of `{{"text", "source"}}`: docstrings (>= {min_chars} characters, dedented) of
  public stdlib modules and of the public classes they define, ordered by module name; `source` is
  the module.
- `chat.jsonl`, {n_chat} rows of `{{"messages", "source"}}`: assistant turns are the reference-manual
  topics of `pydoc_data.topics` (cut at a paragraph boundary to <= {max_topic} characters) and
  docstrings of public stdlib functions; user turns are short templated questions (the only text
  written here). {n_system} rows start with a system message, {n_multi} have two user/assistant exchanges.
- `prompts.jsonl`, {n_prompts} rows of `{{"messages", "source"}}`: held-out user questions about stdlib
  functions that `chat.jsonl` leaves out, as prompts for `dflash spec`.

Sizes: {text_bytes:,} + {chat_bytes:,} bytes; {tokens} tokens under the `data/tiny-target` tokenizer
(chat rows rendered with its chat template).

Regenerate (deterministic: byte-identical output for the same Python build):

    python scripts/make_sample_data.py

Made with Python {py_full}.
"""


def count_tokens(tokenizer_dir: Path, text_rows, chat_rows) -> tuple[int, int] | None:
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text_ids = tok([r["text"] for r in text_rows], add_special_tokens=False)["input_ids"]
    rendered = [tok.apply_chat_template(r["messages"], tokenize=False) for r in chat_rows]
    chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    # The data never contains the special tokens' strings: text rows are plain, chat rows only the
    # template's <|im_start|> / <|im_end|>; in particular the drafter's MASK token never occurs.
    text_specials = {t for ids in text_ids for t in ids if t in tok.all_special_ids}
    chat_specials = {tok.convert_ids_to_tokens(t) for ids in chat_ids for t in ids if t in tok.all_special_ids}
    assert not text_specials and chat_specials <= {"<|im_start|>", "<|im_end|>"}, (text_specials, chat_specials)
    return sum(map(len, text_ids)), sum(map(len, chat_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                    help="tokenizer folder used only to print token counts")
    args = ap.parse_args()

    mods = stdlib_modules()
    text_rows, functions = collect(mods)
    kept = spread(functions, N_FUNCTION_ITEMS)
    items = chat_items() + function_items(kept)
    chat_rows = build_chat(items)
    # held-out prompts (for `dflash spec`): questions about the functions the chat rows leave out
    held = function_items([f for f in functions if f not in set(kept)])
    prompt_rows = [{"messages": [{"role": "user", "content": it["question"]}], "source": it["source"]}
                   for it in spread(held, N_PROMPTS)]

    args.out.mkdir(parents=True, exist_ok=True)
    text_path, chat_path = args.out / "text.jsonl", args.out / "chat.jsonl"
    write_jsonl(text_path, text_rows)
    write_jsonl(chat_path, chat_rows)
    write_jsonl(args.out / "prompts.jsonl", prompt_rows)

    n_system = sum(r["messages"][0]["role"] == "system" for r in chat_rows)
    n_multi = sum(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in chat_rows)
    counts = count_tokens(args.tokenizer, text_rows, chat_rows)
    if counts is None:
        tokens = "(not counted: no tokenizer)"
        print(f"no tokenizer at {args.tokenizer}: run scripts/make_tiny_target.py first for token counts")
    else:
        tokens = f"{counts[0]:,} + {counts[1]:,} = {sum(counts):,}"
    py = ".".join(map(str, sys.version_info[:2]))
    readme = README.format(
        py=py, py_full=sys.version.split()[0], n_text=len(text_rows), n_chat=len(chat_rows),
        min_chars=MIN_CHARS, max_topic=MAX_TOPIC_CHARS, n_system=n_system, n_multi=n_multi,
        text_bytes=text_path.stat().st_size, chat_bytes=chat_path.stat().st_size, tokens=tokens,
        n_prompts=len(prompt_rows),
    )
    (args.out / "README.md").write_text(readme, encoding="utf-8")

    print(f"modules imported: {len(mods)}; function docstrings available: {len(functions)}")
    print(f"{text_path}: {len(text_rows)} rows, {text_path.stat().st_size:,} B")
    print(f"{chat_path}: {len(chat_rows)} rows ({n_system} with a system message, {n_multi} multi-turn), "
          f"{chat_path.stat().st_size:,} B")
    print(f"tokens (text + chat): {tokens}")
    print(f"{args.out / 'prompts.jsonl'}: {len(prompt_rows)} held-out prompts")


if __name__ == "__main__":
    main()
