"""Input reading: JSONL / Parquet rows -> tokenized documents with a loss mask.

A row is `{"text": ...}` (loss on every token), `{"prompt": ..., "completion": ...}` (the two texts joined,
loss on the completion's tokens) or `{"messages": [{"role", "content"}, ...]}` rendered with the target
tokenizer's chat template (loss only on assistant tokens). Its row id is its global
index: files are read in the given order and every non-blank JSONL line / Parquet row is one row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dflash.errors import DflashError
from dflash.files import sha256_file

# Why a row yields no document ("no supervised tokens": no assistant turn or an empty completion). The
# index is what the cache stores (`dropped_reasons`); the manifest lists the names.
DROP_REASONS = ("empty text", "no supervised tokens", "too short")


@dataclass(frozen=True)
class Row:
    row_id: int
    where: str  # "file:line" for error messages
    record: dict


@dataclass(frozen=True)
class Doc:
    row_id: int
    input_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] uint8
    truncated: bool


@dataclass(frozen=True)
class Dropped:
    row_id: int
    reason: int  # index into DROP_REASONS


def file_fingerprints(paths: list[str]) -> list[dict]:
    """Path, size and sha256 of each input file (the dataset part of the cache key)."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise DflashError(f"--data {p}: no such file")
        out.append({"path": str(path.resolve()), "size": path.stat().st_size, "sha256": sha256_file(path)})
    return out


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation rendered with the chat template, ending with the generation prompt of the assistant's
    next turn: the token ids the target answers (`dflash regenerate`, `dflash spec`)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_rows(paths: list[str], limit: int | None = None, per_file: dict[str, int] | None = None) -> Iterator[Row]:
    """Every row of every file, in order, with its global row id; stops after `limit` rows.
    `per_file` (if given) receives the row count of each file, by resolved path."""
    row_id = 0
    for p in paths:
        reader = _parquet_rows if p.endswith(".parquet") else jsonl_rows
        key = str(Path(p).resolve())
        for where, record in reader(p):
            if limit is not None and row_id >= limit:
                return
            _check_row(record, where)
            yield Row(row_id, where, record)
            row_id += 1
            if per_file is not None:
                per_file[key] = per_file.get(key, 0) + 1


def jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of each non-empty line; a line that is not UTF-8 or not JSON is one line naming it."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DflashError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DflashError(f"{path}:{lineno}: not UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DflashError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            yield f"{path}:{lineno}", record


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DflashError(f"{path}: reading Parquet needs pyarrow (pip install 'dflash[parquet]')") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and kin: not a Parquet file, or a damaged one
        raise DflashError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, record in enumerate(table.to_pylist()):
        yield f"{path}#row{i}", record


def _check_row(record, where: str) -> None:
    if not isinstance(record, dict):
        raise DflashError(f"{where}: a row must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise DflashError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}}")
    elif "completion" in record:
        if not (isinstance(record.get("prompt"), str) and isinstance(record["completion"], str)):
            raise DflashError(f"{where}: 'prompt' and 'completion' must both be strings")
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise DflashError(f"{where}: 'text' must be a string")
    else:
        raise DflashError(f"{where}: row has none of 'text', 'messages', 'prompt'+'completion' "
                          f"(keys: {', '.join(sorted(record)) or 'none'})")


class Tokenizer:
    """Turns rows into documents: token ids, loss mask, truncation to `max_len`."""

    def __init__(self, tokenizer, max_len: int):
        self.tok = tokenizer
        self.max_len = max_len
        self.eos = tokenizer.eos_token

    def __call__(self, rows: list[Row], batch: int = 512) -> Iterator[Doc | Dropped]:
        for i in range(0, len(rows), batch):
            yield from self._batch(rows[i : i + batch])

    def _batch(self, rows: list[Row]) -> Iterator[Doc | Dropped]:
        texts, spans = [], []
        for row in rows:
            if "messages" in row.record:
                text, row_spans = self._render(row)
            elif "completion" in row.record:  # loss on the completion only
                prompt, completion = row.record["prompt"], row.record["completion"]
                text, row_spans = prompt + completion, [(len(prompt), len(prompt) + len(completion))]
            else:
                text, row_spans = row.record["text"], None  # None: every token is trained on
            texts.append(text)
            spans.append(row_spans)
        chat = [s is not None for s in spans]
        enc_text = self._encode([t for t, c in zip(texts, chat) if not c], special=True, offsets=False)
        enc_chat = self._encode([t for t, c in zip(texts, chat) if c], special=False, offsets=True)
        it_text, it_chat = iter(enc_text), iter(enc_chat)
        for row, row_spans in zip(rows, spans):
            if row_spans is None:
                ids, _ = next(it_text)
                if not row.record["text"].strip():
                    yield Dropped(row.row_id, DROP_REASONS.index("empty text"))
                    continue
                mask = np.ones(len(ids), np.uint8)
            else:
                ids, offsets = next(it_chat)
                mask = _mask_from_spans(offsets, row_spans)
            yield self._finish(row.row_id, ids, mask)

    def _encode(self, texts: list[str], special: bool, offsets: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if not texts:
            return []
        enc = self.tok(texts, add_special_tokens=special, return_offsets_mapping=offsets, return_attention_mask=False)
        offs = enc["offset_mapping"] if offsets else [None] * len(texts)
        return [(np.asarray(ids, np.int32), None if o is None else np.asarray(o, np.int64).reshape(-1, 2))
                for ids, o in zip(enc["input_ids"], offs)]

    def _render(self, row: Row) -> tuple[str, list[tuple[int, int]]]:
        """The chat-template text and the character spans of assistant turns (with their end token)."""
        if not self.tok.chat_template:
            raise DflashError(f"{row.where}: 'messages' rows need a chat template, and the target tokenizer has none")
        try:
            text = self.tok.apply_chat_template(row.record["messages"], tokenize=False)
        except Exception as e:  # jinja errors: bad roles, template-specific checks
            raise DflashError(f"{row.where}: the chat template refused this conversation ({e})") from None
        messages = row.record["messages"]
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            content = m["content"].strip()
            if not content:
                continue
            if m["role"] == "assistant":
                # Start looking where the template's own generation prompt ends, so a reply that
                # repeats a role name ("user") is not found in a turn header.
                prompt = self.tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                if text.startswith(prompt):
                    cursor = max(cursor, len(prompt))
            start = text.find(content, cursor)
            if start < 0:
                continue  # the template rewrote this message; an assistant turn then gets no loss
            end = start + len(content)
            if m["role"] == "assistant":
                after = end + len(text[end:]) - len(text[end:].lstrip(" \t\n"))
                if self.eos and text.startswith(self.eos, after):  # train on the end of the turn too
                    end = after + len(self.eos)
                spans.append((start, end))
            cursor = end
        return text, spans

    def _finish(self, row_id: int, ids: np.ndarray, mask: np.ndarray) -> Doc | Dropped:
        truncated = len(ids) > self.max_len
        ids, mask = ids[: self.max_len], mask[: self.max_len]
        # A drafter anchor needs a trained token and the one after it, so < 2 tokens is useless.
        if len(ids) < 2:
            return Dropped(row_id, DROP_REASONS.index("too short"))
        if not mask[1:].any():
            return Dropped(row_id, DROP_REASONS.index("no supervised tokens"))
        return Doc(row_id, ids, mask, truncated)


def _mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose characters overlap an assistant span."""
    mask = np.zeros(len(offsets), np.uint8)
    for a, b in spans:
        mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.uint8)
    return mask
