"""`dflash regenerate --server URL`: the target's answers from an OpenAI-compatible server (vLLM, SGLang,
`transformers serve`), `concurrency` rows in flight at once.

Each answer is written as soon as it completes, and OUT stays what the in-process path writes: its rows in
input order, a whole prefix of the output at any moment. A row that completes before an earlier one is
appended to OUT.ahead.jsonl (and kept in memory) until every row before it is in OUT; then it moves there.
A run stopped in any way (an error, Ctrl-C, SIGKILL) resumes with the same command: the rows in OUT and in
OUT.ahead.jsonl are finished and never requested again; the others are. A finished run leaves OUT and
OUT.meta.json only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections import deque
from pathlib import Path

from tqdm.auto import tqdm

from dflash import logs
from dflash.config import RegenerateConfig
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error, write_json_atomic, write_text_atomic
from dflash.regenerate import (
    IN_PROCESS_ONLY,
    SERVER_ONLY,
    Job,
    check_settings,
    read_input,
    settings,
    summary_line,
    whole_lines,
)
from dflash.serve_client import ServerClient, api_key, shown

log = logging.getLogger(__name__)

SYNC_EVERY_S = 2.0  # OUT and OUT.ahead.jsonl are flushed at every row (a SIGKILL loses none), fsynced this often


class OrderedOut:
    """OUT in input order, fed rows in any order: those ahead of the next one wait in OUT.ahead.jsonl."""

    def __init__(self, out: Path, total: int):
        self.out, self.ahead_path, self.total = out, Path(str(out) + ".ahead.jsonl"), total
        self.head = 0  # rows in OUT: the next row OUT takes
        self.waiting: dict[int, str] = {}  # rows answered ahead of `head`, by id: their lines
        self.ahead_lines = 0  # lines in OUT.ahead.jsonl (those of rows since moved to OUT included)
        self._synced = time.monotonic()

    def resume(self) -> None:
        """What an earlier run finished: OUT's whole lines, then OUT.ahead.jsonl's rows that are not in OUT."""
        self.head = whole_lines(self.out)
        if self.ahead_path.exists():
            self.ahead_lines = whole_lines(self.ahead_path)
            lines = self.ahead_path.read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines(): U+2028
            for n, line in enumerate(lines, 1):
                row = _row_id(line, self.total, f"{self.ahead_path}:{n}")
                if row >= self.head:
                    self.waiting[row] = line + "\n"

    def open(self) -> None:
        self.f = self.out.open("a", encoding="utf-8")
        self.g = self.ahead_path.open("a", encoding="utf-8")
        self._advance()

    def add(self, row: int, line: str) -> None:
        """A finished row: into OUT if it is the next one (with those waiting behind it), else into the wait."""
        if row == self.head:
            self.waiting[row] = line
            self._advance()
        else:
            self.g.write(line)
            self.g.flush()
            self.ahead_lines += 1
            self.waiting[row] = line
        if time.monotonic() - self._synced > SYNC_EVERY_S:
            self.sync()

    def _advance(self) -> None:
        lines = []
        while self.head in self.waiting:
            lines.append(self.waiting.pop(self.head))
            self.head += 1
        if lines:
            self.f.write("".join(lines))
            self.f.flush()
        if self.ahead_lines - len(self.waiting) >= max(256, 2 * len(self.waiting)):
            self._compact()

    def _compact(self) -> None:
        """OUT.ahead.jsonl rewritten with only the rows still waiting (OUT made durable first)."""
        self.sync()
        self.g.close()
        write_text_atomic(self.ahead_path, "".join(self.waiting[k] for k in sorted(self.waiting)))
        self.g = self.ahead_path.open("a", encoding="utf-8")
        self.ahead_lines = len(self.waiting)

    def sync(self) -> None:
        for f in (self.f, self.g):
            f.flush()
            os.fsync(f.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        """Everything on disk; a complete OUT drops OUT.ahead.jsonl."""
        self.sync()
        self.f.close()
        self.g.close()
        if self.head == self.total:
            self.ahead_path.unlink()

    @property
    def finished(self) -> int:
        return self.head + len(self.waiting)


def _row_id(line: str, total: int, where: str) -> int:
    try:
        row = json.loads(line)["dflash_row"]
    except (ValueError, KeyError, TypeError):
        row = None
    if not isinstance(row, int) or not 0 <= row < total:
        raise DflashError(f"{where}: not a row of this run (delete the file to request its rows again)")
    return row


def row_seed(seed: int, row: int, turn: int) -> int:
    """A request's sampling seed: from --seed, its row and its turn; 31 bits, as every server takes."""
    digest = hashlib.blake2b(f"{seed}:{row}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


_REASONING_FIELD = re.compile(r"""message(?:\.|\[\s*['"])(reasoning_content|thinking|reasoning)\b"""
                              r"""|['"](reasoning_content|thinking|reasoning)['"]\s+in\s+message\b""")


def reasoning_field(tok) -> str:
    """Where an answer's reasoning goes in its message: the field the target's chat template renders
    (`reasoning_content` for Qwen3, DeepSeek, GLM; `thinking` for gpt-oss); `reasoning_content`, the one
    transformers' chat templates read, when there is no template to look at."""
    template = getattr(tok, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(template.values())
    found = {m.group(1) or m.group(2) for m in _REASONING_FIELD.finditer(template)}
    return next((f for f in ("reasoning_content", "thinking", "reasoning") if f in found), "reasoning_content")


def _tokenizer(cfg: RegenerateConfig):
    if not cfg.target:
        return None
    from transformers import AutoTokenizer

    from dflash.target import resolve_target

    path = resolve_target(cfg.target)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DflashError(f"--target {cfg.target}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None


def regenerate_via_server(cfg: RegenerateConfig) -> dict:
    """The event loop runs inside what a stop (Ctrl-C, SIGTERM) and a full disk report: a signal may land in
    the loop itself, outside any task, and the loop then cancels the run (its files closed) before it ends."""
    at: dict = {}  # the run's writer, once there is one: where the run is, for those lines

    def note() -> str:
        w = at["writer"]
        return (f"with {w.finished} of {w.total} rows finished ({w.head} in {w.out}); run the same command again: "
                f"it resumes")

    with disk_full_is_an_error(Path(cfg.out), lambda: f"{at['writer'].finished} rows are finished"), \
            logs.where(note):
        return asyncio.run(_regenerate(cfg, at))


async def _regenerate(cfg: RegenerateConfig, at: dict) -> dict:
    out, meta = Path(cfg.out), Path(cfg.out + ".meta.json")
    client = ServerClient(cfg.server, key=api_key(cfg.api_key_env), timeout=cfg.timeout, retries=cfg.retries,
                          concurrency=cfg.concurrency)
    async with client:
        model = await client.model(cfg.model)  # the server is there, or one line now
        kept = settings(cfg, SERVER_ONLY + IN_PROCESS_ONLY, model=model)
        rows = read_input(cfg)
        writer = OrderedOut(out, len(rows))
        if check_settings(out, meta, kept):
            writer.resume()
        elif writer.ahead_path.exists():
            writer.ahead_path.unlink()  # left by a run that had not written its settings: nothing to keep
        if writer.head >= len(rows):
            writer.ahead_path.unlink(missing_ok=True)
            log.info(f"{out}: all {len(rows)} rows already regenerated: nothing to do")
            return _summary(model, client, len(rows), {"written": 0, "tokens": 0, "cut": 0})
        tok = _tokenizer(cfg)
        todo = [r for r in rows[writer.head:] if r.row_id not in writer.waiting]
        jobs = {r.row_id: Job(r, cfg.turns, tok, cfg.prompt_tokens) for r in todo}  # bad rows stop here
        if writer.finished:
            log.info(f"resuming {out}: {writer.head} rows written, {len(writer.waiting)} more answered ahead; "
                     f"{len(todo)} of {len(rows)} to request")
        out.parent.mkdir(parents=True, exist_ok=True)
        done = {"written": 0, "tokens": 0, "cut": 0}  # this run's rows, their new tokens, those cut
        at["writer"] = writer
        with tqdm(total=len(rows), initial=writer.finished, unit="row", desc=f"regenerate {out.name}",
                  dynamic_ncols=True) as bar:
            write_json_atomic(meta, kept)
            writer.open()
            try:
                await _drive(cfg, client, model, reasoning_field(tok), jobs, writer, done, bar)
            except DflashError as e:
                raise DflashError(f"{e}; {writer.finished} rows are finished ({writer.head} in {out}): run the "
                                  f"same command again to resume") from None
            finally:
                writer.close()
    return _summary(model, client, len(rows), done, out)


async def _drive(cfg, client: ServerClient, model: str, field: str, jobs: dict[int, Job], writer: OrderedOut,
                 done: dict, bar) -> None:
    """`concurrency` rows in flight, each written as it finishes; no row starts further than `window` rows past
    the first unfinished one, so what waits for an earlier row stays bounded."""
    window = max(1024, 16 * cfg.concurrency)
    queue, pending = deque(sorted(jobs)), set()

    def fill() -> None:
        while queue and len(pending) < cfg.concurrency and queue[0] < writer.head + window:
            pending.add(asyncio.ensure_future(_run_job(cfg, client, model, field, jobs.pop(queue.popleft()))))

    try:
        fill()
        while pending:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending -= finished
            failed = [t.exception() for t in finished if t.exception() is not None]
            for t in finished:
                if t.exception() is None:
                    job = t.result()
                    writer.add(job.row.row_id, job.line())
                    done["written"] += 1
                    done["tokens"] += job.tokens
                    done["cut"] += "length" in job.finish
                    bar.update(1)
            if failed:
                raise failed[0]
            fill()
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _run_job(cfg, client: ServerClient, model: str, field: str, job: Job) -> Job:
    """Every turn of one row, in order: each request carries the conversation as regenerated so far."""
    while job.todo:
        body = {"model": model, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                "top_p": cfg.top_p, "seed": row_seed(cfg.seed, job.row.row_id, len(job.finish))}
        if job.chat:
            body["messages"] = job.messages()
            if job.tools:
                body["tools"] = job.tools
            ans = await client.chat(body, job.where())
        else:
            ans = await client.complete({**body, "prompt": job.prompt_text}, job.where())
        job.tokens += ans.tokens
        job.answer(ans.content, ans.finish_reason, ans.reasoning, ans.tool_calls, field)
    return job


def _summary(model: str, client: ServerClient, rows: int, done: dict, out: Path | None = None) -> dict:
    tokens, cut = done["tokens"], done["cut"]
    if out is not None:
        log.info(summary_line(out, rows, done["written"], cut, f" through {shown(client.url)} ({client.requests} "
                                                         f"requests, {client.retried} retried, {tokens:,} new tokens)"))
    return {"rows": rows, "written": done["written"], "tokens": tokens, "cut_by_length": cut,
            "requests": client.requests, "retried": client.retried, "server": shown(client.url), "model": model}
