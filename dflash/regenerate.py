"""`dflash regenerate`: rewrite a dataset's responses with the target's own generations.

Drafters are trained on what the target itself would say, because that is what acceptance is measured
against. `messages` rows keep every turn before their last assistant turn and get a new last assistant
turn; `text` rows keep their first `prompt_tokens` tokens and get the target's continuation.

Output is JSONL in input order, written a chunk (8 batches) at a time; the same command resumes an
interrupted run from its last whole chunk (the settings are kept in OUT.meta.json and must match), so
even a sampled run resumes to the same file.
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
from dflash.data import Row, chat_prompt_ids, file_fingerprints, read_rows
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error, write_json_atomic

log = logging.getLogger(__name__)


def _prompt(row: Row, tok, prompt_tokens: int) -> tuple[list[int], list[dict] | None]:
    """(prompt token ids, the kept messages of a chat row, or None for a text row)."""
    rec = row.record
    if "messages" in rec:
        msgs = rec["messages"]
        end = len(msgs) - 1 if msgs and msgs[-1]["role"] == "assistant" else len(msgs)
        kept = msgs[:end]
        if not any(m["role"] == "user" for m in kept):
            raise DflashError(f"{row.where}: no user turn to answer")
        return chat_prompt_ids(tok, kept), kept
    ids = tok(rec["text"])["input_ids"][:prompt_tokens]
    if not ids:
        raise DflashError(f"{row.where}: empty text, nothing to continue")
    return ids, None


def _settings(cfg: RegenerateConfig, target_path) -> dict:
    from transformers import AutoConfig

    from dflash.target import config_hash, weights_fingerprint

    # batch_size stays: it sets the chunks, and each chunk's sampling seed
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("out", "device", "device_map", "data", "target")}
    return {**keep, "target_config": config_hash(AutoConfig.from_pretrained(target_path)),
            "target_weights": weights_fingerprint(target_path),
            "data_sha256": [f["sha256"] for f in file_fingerprints(cfg.data)]}


def _resume_point(out: Path, meta: Path, settings: dict, chunk: int) -> int:
    """Rows already written, rounded down to a whole chunk (the file is cut back there, so the resumed
    run samples exactly as an uninterrupted one); refuses other settings."""
    if not out.exists():
        if meta.exists():
            meta.unlink()
        return 0
    if not meta.exists():
        raise DflashError(f"--out {out} exists and was not written by dflash regenerate (no {meta.name})")
    old = json.loads(meta.read_text())
    diffs = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    if diffs:
        raise DflashError(f"--out {out} was generated with other settings ({', '.join(diffs)}); use another --out")
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


def regenerate(cfg: RegenerateConfig) -> dict:
    from dflash.target import load_target, resolve_device, resolve_dtype, resolve_target

    out, meta = Path(cfg.out), Path(cfg.out + ".meta.json")
    target_path = resolve_target(cfg.target)
    settings = _settings(cfg, target_path)
    chunk = cfg.batch_size * 8  # rows sorted by prompt length within a chunk, written in order after it
    done = _resume_point(out, meta, settings, chunk)
    rows = list(read_rows(cfg.data, cfg.limit))
    if not rows:
        raise DflashError(f"--data {', '.join(cfg.data)}: no rows")
    if done >= len(rows):
        log.info(f"{out}: all {len(rows)} rows already regenerated: nothing to do")
        return {"rows": len(rows), "written": 0}
    device = resolve_device(cfg.device)
    model, tok = load_target(target_path, device, resolve_dtype(cfg.dtype, device), device_map=cfg.device_map)
    tok.padding_side = "left"
    if done:
        log.info(f"resuming {out} at row {done} of {len(rows)}")
    bar = tqdm(total=len(rows), initial=done, unit="row", desc=f"regenerate {out.name}", dynamic_ncols=True)
    tokens, written = 0, done
    with disk_full_is_an_error(out, lambda: f"its first {written} rows are written"), bar, \
            logs.where(lambda: f"with {written} of {len(rows)} rows written; run the same command again: it resumes"):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(meta, settings)
        with out.open("a", encoding="utf-8") as f:
            for start in range(done, len(rows), chunk):
                part = rows[start : start + chunk]
                prompts = [_prompt(r, tok, cfg.prompt_tokens) for r in part]
                torch.manual_seed(cfg.seed + start)  # sampling is reproducible chunk by chunk
                gens = _generate(model, tok, [p[0] for p in prompts], cfg)
                tokens += sum(len(g) for g in gens)
                f.write("".join(json.dumps(_rewrite(row, prompts[i], gens[i], tok), ensure_ascii=False) + "\n"
                                for i, row in enumerate(part)))  # one write per chunk
                f.flush()
                os.fsync(f.fileno())
                written = start + len(part)
                bar.update(len(part))
    log.info(f"{out}: {len(rows)} rows, {tokens:,} new tokens generated in this run")
    return {"rows": len(rows), "written": len(rows) - done, "tokens": tokens}


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


def _rewrite(row: Row, prompt, gen: list[int], tok) -> dict:
    ids, kept = prompt
    rec = dict(row.record)
    if kept is not None:
        rec["messages"] = kept + [{"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)}]
    else:
        rec["text"] = tok.decode(ids + gen, skip_special_tokens=True)
    rec["dflash_row"] = row.row_id
    return rec
