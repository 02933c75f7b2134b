"""Train the embedded tiny target: a small Qwen3 causal LM on the Python standard library's own source.

Real text nobody here wrote, on every machine. Uses the tokenizer already in data/tiny-target (byte-level
BPE trained on the same source, with the chat template and the <|mask|> token); replaces the weights
and config there and records how they were made in data/tiny-target/TRAINING.json.

    python scripts/train_tiny_target.py --out data/tiny-target --minutes 4          # on the GPU
    python scripts/train_tiny_target.py --out /tmp/t --smoke                         # a CPU check of the script
    python scripts/train_tiny_target.py --arch qwen3_5 --out data/tiny-hybrid-target # the GatedDeltaNet hybrid

`--arch qwen3_5`: a Qwen3.5-style hybrid of the same widths, two GatedDeltaNet layers before each full
attention layer (Qwen3.5 has three), for speculative decoding on a hybrid target. It trains through
transformers' torch path of GatedDeltaNet, uncompiled: fla's backward needs Triton >= 3.7.1.

Held-out: every 20th stdlib file (by sorted path) is kept out of training; its loss is measured every
`--eval-every` steps and the weights with the best held-out loss are the ones saved (the corpus is small:
a long run overfits: on the H200 an epoch takes ~3 s, so `--epochs` rather than `--minutes`). The stdlib's
file set differs between Python builds (the GPU machine's is slim): `--corpus` carries one build's tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
SKIP = ("idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "encodings", "site-packages", "pydoc_data",
        "__pycache__")
HELD_OUT_EVERY = 20


def stdlib_files() -> list[Path]:
    """The corpus's files in their fixed order; file i is held out when i % HELD_OUT_EVERY == 0."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not any(part in SKIP for part in p.relative_to(root).parts))


def corpus(tokenizer) -> tuple[np.ndarray, np.ndarray, int]:
    """(train tokens, held-out tokens, files) of the stdlib's .py sources; documents end with <|endoftext|>."""
    files = stdlib_files()
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    train, held = [], []
    for i, p in enumerate(files):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eot]
        (held if i % HELD_OUT_EVERY == 0 else train).append(np.asarray(ids, np.int32))
    return np.concatenate(train), np.concatenate(held), len(files)


def load_corpus(path: str | None, tokenizer) -> tuple[np.ndarray, np.ndarray, int, str]:
    """The corpus from `path` (.npz) when it exists, else built from this Python's stdlib (and saved
    to `path` if given): the file set differs between Python builds, so a corpus travels as a file."""
    if path and Path(path).exists():
        z = np.load(path)
        return z["train"], z["held"], int(z["files"]), str(z["python"])
    train, held, files = corpus(tokenizer)
    if path:
        np.savez(path, train=train.astype(np.uint16), held=held.astype(np.uint16), files=files,
                 python=sysconfig.get_python_version())
    return train, held, files, sysconfig.get_python_version()


def batches(tokens: np.ndarray, seq: int, batch: int, rng: np.random.Generator):
    """Random windows of seq+1 tokens, forever."""
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        yield torch.from_numpy(np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def held_out_loss(model, tokens: np.ndarray, seq: int, device, max_windows: int = 256) -> float:
    model.eval()
    n = min(max_windows, (len(tokens) - 1) // seq)
    losses = []
    for i in range(0, n, 16):
        x = torch.from_numpy(np.stack([tokens[j * seq : j * seq + seq + 1] for j in range(i, min(i + 16, n))])
                             .astype(np.int64)).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def model_config(arch: str, tok, hidden: int, layers: int):
    sizes = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                 num_attention_heads=hidden // 64 or 1, num_key_value_heads=max(1, hidden // 128),
                 head_dim=64 if hidden >= 64 else hidden, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "qwen3":
        return AutoConfig.for_model("qwen3", **sizes)
    heads = max(1, hidden // 64)  # GatedDeltaNet heads as wide as the attention heads
    kinds = ["linear_attention", "linear_attention", "full_attention"]
    return AutoConfig.for_model("qwen3_5_text", **sizes, layer_types=[kinds[i % 3] for i in range(layers)],
                                linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=64,
                                linear_value_head_dim=64, linear_conv_kernel_dim=4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--arch", choices=["qwen3", "qwen3_5"], default="qwen3",
                   help="dense Qwen3 or a GatedDeltaNet hybrid")
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget (unless --epochs)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the corpus (replaces --minutes)")
    p.add_argument("--corpus", default=None, help=".npz of tokens: loaded if it exists, else built and saved")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--patience", type=int, default=10, help="stop after this many evals without a better held-out loss")
    p.add_argument("--smoke", action="store_true", help="a few CPU steps at toy size")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.seq, args.batch, args.max_steps, args.eval_every = 64, 3, 128, 4, 6, 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-target")
    t0 = time.time()
    train_tokens, held_tokens, n_files, corpus_python = load_corpus(args.corpus, tok)
    train_tokens, held_tokens = train_tokens.astype(np.int32), held_tokens.astype(np.int32)
    print(f"corpus (Python {corpus_python} stdlib): {n_files} files, {len(train_tokens):,} train / "
          f"{len(held_tokens):,} held-out tokens ({time.time() - t0:.0f}s)", flush=True)
    config = model_config(args.arch, tok, args.hidden, args.layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.config.use_cache = False  # training: no KV / recurrent cache (set back before saving)
    n_params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    step_fn = torch.compile(model) if device.type == "cuda" and args.arch == "qwen3" else model
    data = batches(train_tokens, args.seq, args.batch, np.random.default_rng(0))
    budget = args.minutes * 60
    # the schedule needs a length: --epochs, or the speed of steps 10..40 (after the compile) and --minutes
    est_steps, step, start, log = args.max_steps or 10**9, 0, time.time(), []
    if args.epochs and not args.max_steps:
        est_steps = int(args.epochs * len(train_tokens) / (args.batch * args.seq))
    best = (float("inf"), 0, None)
    while step < est_steps:
        x = next(data).to(device, non_blocking=True)
        warm = 100
        frac = step / max(est_steps, 1)
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = step_fn(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 10:
            t10 = time.time()  # past the compile
        # host sync (loss.item) below is only at evals
        if step == 40 and args.max_steps is None and args.epochs is None:
            per_step = (time.time() - t10) / 30
            est_steps = 40 + int((budget - (time.time() - start)) / per_step)
            print(f"~{per_step * 1e3:.0f} ms/step: {est_steps} steps in {args.minutes} min", flush=True)
        if step % args.eval_every == 0 or step == est_steps:
            held = held_out_loss(model, held_tokens, args.seq, device)
            log.append({"step": step, "loss": loss.item(), "held_out_loss": held,
                        "seconds": round(time.time() - start, 1)})
            print(json.dumps(log[-1]), flush=True)
            if held < best[0]:
                best = (held, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            elif step - best[1] >= args.patience * args.eval_every:
                print(f"held-out loss has not improved for {args.patience} evals: stopping", flush=True)
                break
    if best[2] is None:  # ended before its first evaluation
        best = (held_out_loss(model, held_tokens, args.seq, device), step, model.state_dict())
    held, best_step, state = best
    model.load_state_dict(state)
    print(f"best held-out loss {held:.3f} at step {best_step} of {step} ({step * args.batch * args.seq:,} tokens seen)",
          flush=True)

    out = Path(args.out)
    if out.resolve() != (REPO / "data" / "tiny-target").resolve():
        shutil.copytree(REPO / "data" / "tiny-target", out, dirs_exist_ok=True)
    model.config.use_cache = True
    model.config.dflash_mask_token_id = tok.convert_tokens_to_ids("<|mask|>")
    # it ends a "file" with <|endoftext|> (it never saw a chat turn end): both stop generation
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out)
    record = {"what": f"{type(model).__name__} trained on the CPython standard library's .py sources",
              "script": "scripts/train_tiny_target.py", "args": vars(args), "parameters": n_params,
              "train_tokens_seen": step * args.batch * args.seq, "corpus_train_tokens": int(len(train_tokens)),
              "held_out_tokens": int(len(held_tokens)), "corpus_python": corpus_python, "held_out_loss": held,
              "best_step": best_step, "steps": step,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "log": log}
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved {out} ({size / 1e6:.1f} MB, {n_params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
