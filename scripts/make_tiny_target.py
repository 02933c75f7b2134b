#!/usr/bin/env python
"""Build `data/tiny-target/`: a tiny Qwen3 causal LM with its own byte-level BPE tokenizer.

The folder is the embedded default target model: small enough to commit, loadable offline with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`. The weights it writes are a
seeded random init of the first, 128-wide shape; the committed weights (hidden 256, trained on the
stdlib) come from `scripts/train_tiny_target.py`, which reuses this tokenizer. This script refuses to
replace them unless given `--force`.

- Tokenizer: byte-level BPE (vocab 4096 including the special tokens) trained with `tokenizers` on
  the first 16 KiB of every `.py` file of the running Python's standard library (test packages,
  GUI/demo packages and the generated `encodings` tables left out), read in sorted path order.
  Special tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), `<|mask|>` (the
  drafter's MASK token; only the literal string `<|mask|>` encodes to it). No BOS. ChatML chat
  template (Qwen style).
- Model: `Qwen3ForCausalLM`, hidden 128, 6 layers, 4 heads / 2 KV heads of dim 32, MLP 384,
  untied embeddings, `torch.manual_seed(0)` init, saved as bfloat16 safetensors. config.json also
  carries `dflash_mask_token_id`.

Deterministic: running it twice gives byte-identical files (same Python / transformers versions).

    python scripts/make_tiny_target.py [--out data/tiny-target]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from pathlib import Path

# Fixed thread counts: nothing here should depend on how many cores the machine has.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "data" / "tiny-target"

VOCAB_SIZE = 4096
PAD, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, MASK]  # ids 0..3, in this order

# Package directories of the stdlib whose sources do not go into the tokenizer corpus.
EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "tkinter", "lib2to3", "turtledemo", "ensurepip", "pydoc_data",
    "site-packages", "dist-packages", "__pycache__",
    "encodings",  # generated codec tables: mostly \uXXXX escapes, they would skew the vocabulary
}
PER_FILE_CHARS = 16 * 1024
TOTAL_CHARS = 4 * 1024 * 1024

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=4096,
)
ROPE_THETA = 10000.0


def stdlib_corpus() -> list[str]:
    """The first PER_FILE_CHARS (cut at a line end) of each stdlib .py file, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n")
        if len(text) > PER_FILE_CHARS:
            cut = text.rfind("\n", 0, PER_FILE_CHARS)
            text = text[: cut + 1 if cut > 0 else PER_FILE_CHARS]
        if not text.strip():
            continue
        texts.append(text)
        total += len(text)
        if total >= TOTAL_CHARS:
            break
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # As Qwen's tokenizer.json: adds no special tokens, keeps offsets on the raw characters (leading
    # spaces included). transformers 5 replaces it with an empty TemplateProcessing if the wrapper is
    # given add_bos_token / add_eos_token, so build_hf_tokenizer does not pass those.
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def build_hf_tokenizer(tok: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, MASK],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def build_model(hf_tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    mask_id = hf_tok.convert_tokens_to_ids(MASK)
    config = Qwen3Config(
        vocab_size=len(hf_tok),
        **MODEL_SHAPE,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        dtype="bfloat16",
    )
    config.dflash_mask_token_id = mask_id
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(config, dtype=torch.float32)  # init in fp32, then cast
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    return model


MODEL_CARD = """\
# tiny-target

A tiny Qwen3-architecture causal language model used as `dflash`'s embedded default target: small
enough to live in the repository, so tests, examples and smoke runs need no model download.

**Its weights are random** (seeded init, `torch.manual_seed(0)`). A later change will train it; until
then its predictions carry no meaning, only its shapes, tokenizer and chat template do.

| field | value |
|---|---|
| architecture | `Qwen3ForCausalLM` |
| hidden size / layers | {hidden_size} / {num_hidden_layers} |
| attention heads / KV heads / head dim | {num_attention_heads} / {num_key_value_heads} / {head_dim} |
| MLP size | {intermediate_size} |
| vocabulary | {vocab} (byte-level BPE, {n_special} special tokens) |
| max positions / RoPE theta | {max_position_embeddings} / {rope_theta:g} |
| embeddings | untied |
| parameters | {n_params:,} (bfloat16 safetensors) |

Tokenizer: byte-level BPE trained with `tokenizers` on the Python {py} standard library sources
(first 16 KiB of each `.py` file; test, GUI/demo and `encodings` packages left out). No BOS token;
`decode(encode(s)) == s` for any text. Special tokens (id: token, role):

{special_rows}

`<|mask|>` is the MASK token of the DFlash drafter: text never produces it unless it holds that exact
string. Its id is also in `config.json` as `dflash_mask_token_id`.

Chat template: ChatML (Qwen style), each message `<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n`, and
`<|im_start|>assistant\\n` with `add_generation_prompt=True`.

Regenerate (deterministic, byte-identical for the same Python / transformers versions):

    python scripts/make_tiny_target.py

Made with Python {py}, torch {torch_v}, transformers {tf_v}, tokenizers {tok_v}.
"""


def write_card(out: Path, hf_tok, model) -> None:
    import tokenizers
    import transformers

    roles = {PAD: "padding (also the end-of-text marker)", IM_START: "start of a chat turn",
             IM_END: "end of a chat turn; EOS", MASK: "DFlash drafter MASK token (reserved)"}
    # A list, not a table: the tokens' `|` would split table cells even inside code spans.
    rows = "\n".join(f"- {hf_tok.convert_tokens_to_ids(t)}: `{t}`, {roles[t]}" for t in SPECIAL_TOKENS)
    card = MODEL_CARD.format(
        **MODEL_SHAPE,
        rope_theta=ROPE_THETA,
        vocab=len(hf_tok),
        n_special=len(SPECIAL_TOKENS),
        n_params=sum(p.numel() for p in model.parameters()),
        py=".".join(map(str, sys.version_info[:3])),
        special_rows=rows,
        torch_v=torch.__version__.split("+")[0],
        tf_v=transformers.__version__,
        tok_v=tokenizers.__version__,
    )
    (out / "README.md").write_text(card, encoding="utf-8")


ROUNDTRIP_SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces, trailing spaces   \n\n\ttabs\r\nand CRLF",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🐍🚀, combining e\u0301, zero-width\u200b.",
    "Special-looking text <|im_end|> inside content <|endoftext|>.",
    "",
]


def check(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert tok.bos_token is None and tok.eos_token == IM_END and tok.pad_token == PAD
    for s in ROUNDTRIP_SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        back = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert back == s, (s, back)
    mask_id = tok.convert_tokens_to_ids(MASK)
    plain = "\n".join(s for s in ROUNDTRIP_SAMPLES if "<|" not in s)
    assert mask_id not in tok.encode(plain, add_special_tokens=False)
    assert model.config.dflash_mask_token_id == mask_id
    assert model.config.vocab_size == len(tok)

    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does `json.dumps` do?"},
        {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
    ]
    rendered = tok.apply_chat_template(conv, tokenize=False)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
    assert rendered == expected, rendered
    prompt = tok.apply_chat_template(conv[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids(IM_START) == ids[0] and ids.count(tok.eos_token_id) == 3

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()

    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"reloaded offline: forward ok, logits {tuple(logits.shape)} {logits.dtype}, model dtype {model.dtype}")
    print("chat template render:\n" + prompt)
    print("special token ids:", {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS})
    print(f"mask token id: {mask_id}")
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    for p in sorted(out.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size:>10,d} B")
    print(f"folder size: {size:,} B ({size / 2**20:.2f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="replace a folder that holds trained weights")
    args = ap.parse_args()
    out: Path = args.out
    if (out / "TRAINING.json").exists() and not args.force:
        sys.exit(f"error: {out} holds trained weights (TRAINING.json): --force replaces them with a random init")

    texts = stdlib_corpus()
    print(f"tokenizer corpus: {len(texts)} stdlib files, {sum(map(len, texts)):,} chars")
    tok = train_tokenizer(texts)
    hf_tok = build_hf_tokenizer(tok)
    assert [hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(hf_tok) == VOCAB_SIZE, len(hf_tok)
    model = build_model(hf_tok)

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf_tok.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    write_card(out, hf_tok, model)
    check(out)


if __name__ == "__main__":
    main()
