"""`dflash regenerate`: rewrite a dataset's responses with the target's own generations.

Drafters are trained on what the target itself would say, because that is what acceptance is measured
against. A `messages` row gets the target's answer in place of every assistant turn, turn by turn, each given
the conversation so far (`--turns last`: only the last one); a conversation that ends on another role gets a
new last assistant turn. A `text` row keeps its first `prompt_tokens` tokens and gets the target's
continuation; a `prompt` + `completion` row gets a new completion. Every row says why each of its generations
stopped (`dflash_finish_reasons`: `stop`, or `length` at `max_new_tokens`).

The target runs in this process (HF `generate`, batched), or behind an OpenAI-compatible server (`--server`:
dflash/regenerate_server.py). Either way the output is JSONL in input order; in-process it is written a chunk
(8 batches) at a time, and the same command resumes an interrupted run from its last whole chunk (the settings
are kept in OUT.meta.json and must match), so even a sampled run resumes to the same file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash import logs
from dflash.config import RegenerateConfig
from dflash.data import Row, file_fingerprints, read_rows
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error, write_json_atomic

log = logging.getLogger(__name__)

# fields that change no row of the output, or that belong to the other path (the server's own, in-process)
_NEVER_KEPT = ("out", "data", "target")
SERVER_ONLY = ("server", "model", "api_key_env", "concurrency", "timeout", "retries")
IN_PROCESS_ONLY = ("device", "dtype", "device_map", "batch_size")


class Job:
    """One row on its way through regeneration: what is generated next, and what came back so far."""

    def __init__(self, row: Row, turns: str, tok, prompt_tokens: int):
        rec = row.record
        self.row, self.finish, self.tokens = row, [], 0
        self.msgs = self.prompt_text = self.prompt_ids = self.text = None
        self.tools = rec.get("tools") if "messages" in rec else None
        if "messages" in rec:
            self.msgs = [dict(m) for m in rec["messages"]]
            self.todo = chat_turns(row, turns)
        elif "completion" in rec:
            self.todo, self.prompt_text = [0], rec["prompt"]
            if not self.prompt_text:
                raise DflashError(f"{row.where}: empty prompt, nothing to complete")
            if tok is not None:
                self.prompt_ids = tok(self.prompt_text)["input_ids"]
        else:
            if tok is None:
                raise DflashError(f"{row.where}: a text row's prompt is its first --prompt-tokens tokens: pass "
                                  f"--target (the served model's folder or hub id) for its tokenizer")
            self.todo, self.prompt_ids = [0], tok(rec["text"])["input_ids"][:prompt_tokens]
            if not self.prompt_ids:
                raise DflashError(f"{row.where}: empty text, nothing to continue")
            self.prompt_text = tok.decode(self.prompt_ids, skip_special_tokens=True)

    @property
    def chat(self) -> bool:
        return self.msgs is not None

    def messages(self) -> list[dict]:
        """The conversation the next turn answers: every message before it, earlier answers regenerated."""
        return self.msgs[: self.todo[0]]

    def where(self) -> str:
        """The row (and the turn, in a conversation of several) for messages."""
        turn = f" (assistant turn {len(self.finish) + 1} of {len(self.finish) + len(self.todo)})"
        return self.row.where + (turn if self.chat and len(self.finish) + len(self.todo) > 1 else "")

    def answer(self, content: str, finish: str | None, reasoning: str | None = None, tool_calls=None,
               reasoning_field: str = "reasoning_content") -> None:
        """The next turn's generation came back: it takes its place."""
        i = self.todo.pop(0)
        self.finish.append(finish)
        if not self.chat:
            self.text = content
            return
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg[reasoning_field] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if i == len(self.msgs):
            self.msgs.append(msg)
        else:
            self.msgs[i] = msg

    def record(self) -> dict:
        rec = dict(self.row.record)
        if self.chat:
            rec["messages"] = self.msgs
        elif "completion" in rec:
            rec["completion"] = self.text
        else:
            rec["text"] = self.prompt_text + self.text
        rec["dflash_row"] = self.row.row_id
        rec["dflash_finish_reasons"] = self.finish
        return rec

    def line(self) -> str:
        return json.dumps(self.record(), ensure_ascii=False) + "\n"


def chat_turns(row: Row, turns: str) -> list[int]:
    """Indices of the messages a conversation regenerates, in order (len(messages): a new last assistant turn).
    Assistant turns before the first user turn are kept as they are."""
    msgs = row.record["messages"]
    last = len(msgs) - 1 if msgs and msgs[-1]["role"] == "assistant" else len(msgs)
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), last)
    if first_user >= last:
        raise DflashError(f"{row.where}: no user turn to answer")
    if turns == "last":
        return [last]
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > first_user] + \
        ([last] if last == len(msgs) else [])


def settings(cfg: RegenerateConfig, drop: tuple[str, ...], **extra) -> dict:
    """What OUT.meta.json keeps: the options that change the output, what names the target, the data's hashes."""
    keep = {k: v for k, v in asdict(cfg).items() if k not in _NEVER_KEPT + drop}
    return {**keep, **extra, "data_sha256": [f["sha256"] for f in file_fingerprints(cfg.data)]}


def _settings(cfg: RegenerateConfig, target_path) -> dict:
    from transformers import AutoConfig

    from dflash.target import config_hash, weights_fingerprint

    # batch_size stays: it sets the chunks, and each chunk's sampling seed
    drop = tuple(k for k in SERVER_ONLY + IN_PROCESS_ONLY if k != "batch_size")
    return settings(cfg, drop, target_config=config_hash(AutoConfig.from_pretrained(target_path)),
                    target_weights=weights_fingerprint(target_path))


def check_settings(out: Path, meta: Path, settings: dict) -> bool:
    """Whether OUT holds a run to resume (with these settings: another run's is refused)."""
    if not out.exists():
        if meta.exists():
            meta.unlink()
        return False
    if not meta.exists():
        raise DflashError(f"--out {out} exists and was not written by dflash regenerate (no {meta.name})")
    old = json.loads(meta.read_text())
    diffs = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    if diffs:
        raise DflashError(f"--out {out} was generated with other settings ({', '.join(diffs)}); use another --out")
    return True


def whole_lines(out: Path) -> int:
    """The rows (whole lines) in OUT; a torn last line (a crash mid-write) is cut off."""
    data = out.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with out.open("r+b") as f:
            f.truncate(keep)
    return data.count(b"\n")


def _resume_point(out: Path, meta: Path, settings: dict, chunk: int) -> int:
    """Rows already written, rounded down to a whole chunk (the file is cut back there, so the resumed
    run samples exactly as an uninterrupted one); refuses other settings."""
    if not check_settings(out, meta, settings):
        return 0
    data = out.read_bytes()
    lines = data.count(b"\n")
    done = lines - lines % chunk
    keep = 0
    for _ in range(done):
        keep = data.index(b"\n", keep) + 1
    if keep != len(data):
        with out.open("r+b") as f:  # a crash mid-chunk: drop the partial chunk
            f.truncate(keep)
    return done


def read_input(cfg: RegenerateConfig) -> list[Row]:
    rows = list(read_rows(cfg.data, cfg.limit))
    if not rows:
        raise DflashError(f"--data {', '.join(cfg.data)}: no rows")
    return rows


def summary_line(out: Path, rows: int, written: int, cut: int, how: str) -> str:
    return (f"{out}: {rows} rows; {written} regenerated in this run{how}; {cut} of them cut at --max-new-tokens "
            f"(finish reason `length`)")


def regenerate(cfg: RegenerateConfig) -> dict:
    """Regenerate `cfg.data` into `cfg.out`; the summary: rows, written (this run), tokens, cut_by_length."""
    if cfg.server is not None:
        from dflash.regenerate_server import regenerate_via_server

        return regenerate_via_server(cfg)
    from dflash.target import load_target, resolve_device, resolve_dtype, resolve_target

    out, meta = Path(cfg.out), Path(cfg.out + ".meta.json")
    target_path = resolve_target(cfg.target)
    settings = _settings(cfg, target_path)
    chunk = cfg.batch_size * 8  # rows sorted by prompt length within a chunk, written in order after it
    done = _resume_point(out, meta, settings, chunk)
    rows = read_input(cfg)
    if done >= len(rows):
        log.info(f"{out}: all {len(rows)} rows already regenerated: nothing to do")
        return {"rows": len(rows), "written": 0, "tokens": 0, "cut_by_length": 0}
    device = resolve_device(cfg.device)
    model, tok = load_target(target_path, device, resolve_dtype(cfg.dtype, device), device_map=cfg.device_map)
    tok.padding_side = "left"
    jobs = [Job(r, cfg.turns, tok, cfg.prompt_tokens) for r in rows[done:]]  # bad rows stop before any work
    if done:
        log.info(f"resuming {out} at row {done} of {len(rows)}")
    bar = tqdm(total=len(rows), initial=done, unit="row", desc=f"regenerate {out.name}", dynamic_ncols=True)
    tokens, cut, written = 0, 0, done
    with disk_full_is_an_error(out, lambda: f"its first {written} rows are written"), bar, \
            logs.where(lambda: f"with {written} of {len(rows)} rows written; run the same command again: it resumes"):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(meta, settings)
        with out.open("a", encoding="utf-8") as f:
            for start in range(done, len(rows), chunk):
                part = jobs[start - done : start - done + chunk]
                torch.manual_seed(cfg.seed + start)  # sampling is reproducible chunk by chunk
                _run_chunk(model, tok, part, cfg)
                tokens += sum(j.tokens for j in part)
                cut += sum("length" in j.finish for j in part)
                f.write("".join(j.line() for j in part))  # one write per chunk
                f.flush()
                os.fsync(f.fileno())
                written = start + len(part)
                bar.update(len(part))
    log.info(summary_line(out, len(rows), len(rows) - done, cut, f" ({tokens:,} new tokens)"))
    return {"rows": len(rows), "written": len(rows) - done, "tokens": tokens, "cut_by_length": cut}


def _run_chunk(model, tok, jobs: list[Job], cfg: RegenerateConfig) -> None:
    """Every turn of every job, a round per turn: round k generates the k-th turn of each job that has one."""
    eos = model.generation_config.eos_token_id or tok.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    while active := [j for j in jobs if j.todo]:
        prompts = [_chat_ids(tok, j) if j.chat else j.prompt_ids for j in active]
        for j, gen in zip(active, _generate(model, tok, prompts, cfg)):
            j.tokens += len(gen)
            j.answer(tok.decode(gen, skip_special_tokens=True), "stop" if gen and gen[-1] in stops else "length")


def _chat_ids(tok, job: Job) -> list[int]:
    """The conversation so far through the chat template (with the row's tools), ending with the generation
    prompt of the assistant's next turn."""
    try:
        text = tok.apply_chat_template(job.messages(), tools=job.tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja errors: bad roles, template-specific checks; no template at all
        raise DflashError(f"{job.where()}: the chat template refused this conversation "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def _generate(model, tok, prompts: list[list[int]], cfg: RegenerateConfig) -> list[list[int]]:
    """The target's generation after each prompt (up to its end token), batched longest first, left-padded."""
    device = model.get_input_embeddings().weight.device  # where generate() takes its inputs
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id or tok.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    sample = cfg.temperature > 0
    gens: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), cfg.batch_size):
        idx = order[b : b + cfg.batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, i in enumerate(idx):
            ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
            att[j, width - len(prompts[i]):] = 1
        with torch.inference_mode():
            res = model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                 max_new_tokens=cfg.max_new_tokens, do_sample=sample,
                                 temperature=cfg.temperature if sample else None,
                                 top_p=cfg.top_p if sample else None, top_k=None,
                                 pad_token_id=pad, eos_token_id=eos)
        for j, i in enumerate(idx):
            gens[i] = _until_eos(res[j, width:].tolist(), eos, pad)
    return gens


def _until_eos(ids: list[int], eos, pad) -> list[int]:
    stops = set(eos if isinstance(eos, list) else [eos])
    for k, t in enumerate(ids):
        if t in stops:
            return ids[: k + 1]
    return ids
