"""Target capture: load a frozen Hugging Face causal LM and run it, keeping only the chosen layers.

Layer id i is the output of decoder layer i, i.e. `output_hidden_states[i + 1]` of a Hugging Face
model; forward hooks on just those layers capture them, so the other layers' states are never kept.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash.errors import DflashError

log = logging.getLogger(__name__)

# Keys of a HF config that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset",
                         "_attn_implementation", "attn_implementation", "use_cache"}


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default (its `build_target_layer_ids`, Python rounding):
    round(1 + k(N-4)/(n-1)) for k = 0..n-1, and [N//2] for n = 1."""
    n, N = num_draft_layers, num_target_layers
    if n == 1:
        return [N // 2]
    ids = [round(1 + k * (N - 4) / (n - 1)) for k in range(n)]
    if len(set(ids)) < n or ids[-1] >= N:
        raise DflashError(f"--draft-layers {n}: a {N}-layer target has too few layers for the default ids; "
                          f"pass --layers")
    return ids


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    if not layer_ids:
        raise DflashError("--layers is empty")
    for i in layer_ids:
        if not 0 <= i < num_target_layers:
            raise DflashError(f"--layers: layer id {i} is beyond the target's depth "
                              f"({num_target_layers} decoder layers: ids 0..{num_target_layers - 1})")
    if len(set(layer_ids)) != len(layer_ids) or sorted(layer_ids) != list(layer_ids):
        raise DflashError(f"--layers must be increasing and distinct, got {layer_ids}")
    return list(layer_ids)


def resolve_target(name: str, trust_remote_code: bool = False) -> Path:
    """The local folder of a target: the path itself, or its snapshot in the Hugging Face cache."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DflashError(f"--target {name}: folder has no config.json (not a Hugging Face model)")
        return path.resolve()
    if path.exists() or name.startswith((".", "/")):
        raise DflashError(f"--target {name}: not a model folder")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    patterns += ["*.py"] if trust_remote_code else []
    for local_only in (True, False):
        try:
            return Path(snapshot_download(name, local_files_only=local_only, allow_patterns=patterns))
        except Exception as e:  # offline, unknown repo, gated repo
            error = e
    raise DflashError(f"--target {name}: not a local folder, and not found in the Hugging Face cache or hub "
                      f"({type(error).__name__})")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_fingerprint(folder: Path, samples: int = 16, block: int = 1 << 20) -> str:
    """A cheap fingerprint of the weight files: names, sizes, safetensors headers and 16 sampled 1 MiB
    blocks per file. Hashing every byte of a 16 GB target would take longer than a small extraction."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    if not files:
        raise DflashError(f"--target {folder}: no weight files (*.safetensors / *.bin)")
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with p.open("rb") as f:
            if p.suffix == ".safetensors":
                header_len = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(header_len, 1 << 26)))
            for k in range(samples):
                f.seek(max(0, (size - block) * k // max(samples - 1, 1)))
                h.update(f.read(block))
    return h.hexdigest()[:16]


def tokenizer_hash(tokenizer) -> tuple[str, str]:
    """(hash of the vocabulary, merges, normalisation and special tokens; hash of the chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True)
    tok = hashlib.sha256((vocab + special).encode()).hexdigest()[:16]
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return tok, hashlib.sha256(template.encode()).hexdigest()[:16]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DflashError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if dev.type == "cuda" and dev.index is None:  # a plain `cuda`: this rank's GPU
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def linear_attention_backend() -> str:
    """Which kernels Hugging Face's GatedDeltaNet layers use here: 'fla' when flash-linear-attention's
    ops import (they need Triton and a GPU build of torch), else transformers' torch fallback."""
    if importlib.util.find_spec("fla") is None:
        return "torch"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:
        return "torch"
    return "fla"


class Target:
    """A frozen causal LM with forward hooks on the captured layers. Its outputs are gathered on `device`
    (default: where its embeddings are), wherever a device map put the layers that computed them."""

    def __init__(self, model, layer_ids: list[int], greedy_chunk: int = 4096, device: torch.device | None = None):
        self.model = model
        self.config = text_config(model.config)
        self.num_layers = self.config.num_hidden_layers
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.backbone = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.input_device = model.get_input_embeddings().weight.device
        self.device = device or self.input_device
        self.greedy_chunk = greedy_chunk
        self._cache_arg = cache_argument(self.backbone.forward)
        self._captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model, self.num_layers)
        for i in self.layer_ids:
            if i < self.num_layers - 1:  # the last layer: HF's hidden_states[N] is after the final norm
                layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Captured layers ([b, n, H] each, in `layer_ids` order) and the final normed hidden [b, n, H].

        Rows are right-padded and no attention mask is passed: in a causal LM a token never sees the
        positions after it, so each document's states are exactly those it gets alone, and SDPA keeps
        its fast causal kernel. `cache`: a Hugging Face KV cache to continue from (decoding)."""
        self._captured.clear()
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        input_ids = input_ids.to(self.input_device, non_blocking=True)
        last = self.backbone(input_ids=input_ids, use_cache=cache is not None, **kwargs).last_hidden_state
        self._captured[self.num_layers - 1] = last
        hidden = [self._captured[i].to(self.device, non_blocking=True) for i in self.layer_ids]  # no-ops on one device
        self._captured.clear()
        return hidden, last.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The target's greedy next token for final hidden states [n, H] -> [n], without ever holding
        more than `greedy_chunk` rows of logits."""
        out = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
        for i in range(0, h.shape[0], self.greedy_chunk):
            out[i : i + self.greedy_chunk] = self.head(h[i : i + self.greedy_chunk]).argmax(-1).to(h.device)
        return out


def cache_argument(forward) -> str:
    """The name `forward` takes its KV cache by: transformers renamed `past_key_values` to `cache` (5.2x)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def decoder_layers(model, num_layers: int) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():  # other layouts: the one ModuleList as long as the model is deep
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise DflashError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def load_target(path: Path, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False,
                attn_implementation: str | None = None, device_map: str | None = None,
                experts_implementation: str = "auto"):
    """(model, tokenizer): the model frozen in eval mode on `device`, or spread over the machine's devices
    by `device_map` (see `parse_device_map`); families that need it made prefix-invariant (families.py);
    MoE experts as `choose_experts` says."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dflash.families import has_linear_attention, make_exact, tune_fla_once

    hf_logging.disable_progress_bar()  # dflash draws its own progress; keep stdout/stderr clean
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if device_map:
        kwargs["device_map"] = parse_device_map(device_map)
        if isinstance(kwargs["device_map"], dict) and "disk" in kwargs["device_map"].values():
            kwargs["offload_folder"] = tempfile.mkdtemp(prefix="dflash-offload-")
            atexit.register(shutil.rmtree, kwargs["offload_folder"], ignore_errors=True)  # lives as the model does
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        raise DflashError(f"--target {path}: cannot load ({str(e).splitlines()[0]})") from None
    if not device_map:
        model.to(device)
    model.eval().requires_grad_(False)
    for note in make_exact(model):
        log.info(note)
    if has_linear_attention(model):
        backend = linear_attention_backend()
        tuned = backend == "fla" and tune_fla_once()
        log.info(f"linear-attention layers run on the {backend} path" + (" (fla kernels autotuned once per width, not "
                 "per forward size)" if tuned else ""))
    choose_experts(model, experts_implementation)
    if device_map:
        placed = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})
        shown = device_map if len(device_map) < 40 else "(map)"
        log.info(f"--device-map {shown}: the target's layers on {', '.join(placed)}")
    return model, tokenizer


def choose_experts(model, requested: str) -> str | None:
    """How an MoE target runs its experts (None: not an MoE). `auto` is transformers' `grouped_mm`: one
    grouped GEMM per projection over the tokens sorted by expert, exact, and on an H200 4.5x the
    per-expert loop (`eager`); `batched_mm` gathers a weight copy per token (memory grows with tokens)."""
    if not type(model)._can_set_experts_implementation():
        return None
    chosen = "grouped_mm" if requested == "auto" else requested
    model.set_experts_implementation(chosen)
    device = model.get_input_embeddings().weight.device
    slow = chosen == "grouped_mm" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)
    log.info(f"MoE experts: {chosen}" + (" (this GPU predates sm80: transformers runs it as a loop over experts)"
                                    if slow else ""))
    return chosen


def parse_device_map(value: str) -> str | dict:
    """`--device-map` as `from_pretrained` takes it: a strategy of transformers (`auto`, `balanced`,
    `balanced_low_0`, `sequential`) or a JSON object of module name -> device (inline or a .json file);
    modules mapped to `disk` are offloaded to a temporary folder."""
    if importlib.util.find_spec("accelerate") is None:
        raise DflashError("--device-map needs the `accelerate` package: pip install accelerate")
    if value in ("auto", "balanced", "balanced_low_0", "sequential"):
        return value
    try:
        text = Path(value).read_text() if value.endswith(".json") else value
        mapping = json.loads(text)
    except (OSError, ValueError) as e:
        raise DflashError(f"--device-map {value}: not a strategy (auto, balanced, sequential) nor a JSON map "
                          f"({e})") from None
    if not isinstance(mapping, dict):
        raise DflashError(f"--device-map {value}: a JSON map must be an object of module name -> device")
    return mapping
