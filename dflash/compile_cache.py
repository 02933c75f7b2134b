"""Compile artifacts of the training step, kept between runs: a run whose step has the same shapes, drafter,
code, torch and device as an earlier one loads what that run compiled and starts warm.

torch keeps them (`torch.compiler.save_cache_artifacts`: Inductor's FX graphs with their Triton kernels,
AOT autograd's graphs, autotuning results) as one blob per process; here one blob per key, in
`$DFLASH_CACHE_DIR/compile/<key>.bin` (default `$XDG_CACHE_HOME/dflash`, else `~/.cache/dflash`). The key
hashes everything that changes the artifacts; the file's header repeats the key's fields and the payload's
sha256, so a file that is corrupt, cut short or for another key is named and ignored before torch sees it.
The folder keeps the KEEP most recently used files (written or loaded).
Nothing here stops a run: an unreadable or unwritable cache is a one-line warning and the step compiles
cold.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from dflash.files import write_bytes_atomic

log = logging.getLogger(__name__)

MAGIC = b"dflash compile artifacts\n"
FORMAT = 1
KEEP = 32  # files kept in the folder; the least recently used go first


def cache_root() -> Path:
    """dflash's user cache folder: $DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash."""
    if os.environ.get("DFLASH_CACHE_DIR"):
        return Path(os.environ["DFLASH_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflash"


def source_hash(*objects) -> str:
    """sha256 of the source of modules, classes or functions: an edited dflash never loads stale graphs."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()[:16]


def environment(device: torch.device) -> dict:
    """What the artifacts depend on outside dflash: Python, torch, Triton and the device they compiled for."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "torch": torch.__version__,
           "triton": triton_version, "machine": platform.machine()}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["device"] = {"name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
                         "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    else:
        env["device"] = device.type
    return env


def cache_counts() -> dict[str, int]:
    """Inductor's graph-cache hits and misses so far in this process (a miss is a graph compiled anew), and
    AOT autograd's hits and bypasses (a bypass retraces the joint graph even when every graph then hits)."""
    from torch._dynamo.utils import counters

    return {"hits": counters["inductor"].get("fxgraph_cache_hit", 0),
            "misses": counters["inductor"].get("fxgraph_cache_miss", 0),
            "autograd_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
            "autograd_bypasses": counters["aot_autograd"].get("autograd_cache_bypass", 0)}


class StepArtifacts:
    """The compile artifacts of one step shape: `load()` before its first call says cold or warm, `finish()`
    after it reports and keeps what was compiled. `enabled` False: always cold, nothing read or written;
    `save` False (DDP ranks but the first): read, never written."""

    def __init__(self, fields: dict, device: torch.device, *, enabled: bool = True, save: bool = True,
                 root: Path | None = None):
        # as JSON has them (a tuple is a list): what a file's header is compared with
        self.fields = json.loads(json.dumps({"format": FORMAT, **environment(device), **fields}, default=str))
        self.key = hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()[:32]
        self.path = (root or cache_root()) / "compile" / f"{self.key}.bin"
        self.enabled, self.may_save = enabled, save
        self.state = "cold"
        self._before = cache_counts()

    def load(self) -> str:
        """Hand this key's artifacts to torch, if there are good ones: "warm", else "cold"."""
        self._before = cache_counts()
        if not self.enabled or not self._supported():
            return self.state
        payload = self._read()
        if payload is None:
            return self.state
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        except Exception as e:  # torch's own check failed: never worth stopping a run
            info = None
            log.warning(f"torch could not load the compile artifacts in {self.path} "
                        f"({type(e).__name__}: {e}); compiling cold")
        else:
            if info is None:
                log.warning(f"torch could not read the compile artifacts in {self.path}; compiling cold")
        self.state = "warm" if info is not None else "cold"
        if self.state == "warm":
            try:
                os.utime(self.path)  # used now: the last to be evicted
            except OSError:
                pass
        return self.state

    def finish(self, seconds: float) -> dict:
        """After the first step: say how long it compiled, keep the artifacts if anything was compiled anew
        (a cold run, or a warm one torch still missed on). Returns the record for the metrics log."""
        now = {k: v - self._before[k] for k, v in cache_counts().items()}
        misses = now["misses"]
        how = self.state
        if self.state == "warm" and misses:
            how = f"warm, {misses} graphs compiled anew"
        elif self.state == "warm" and now["autograd_bypasses"]:
            how = "warm, the joint graph retraced: AOT autograd's cache was bypassed"
        kept = self.enabled and self.may_save and (self.state == "cold" or misses) and self._supported() \
            and self._save()
        log.info(f"compiled the training step ({how}) in {seconds:.1f}s"
                 + (f"; kept for the next run: {self.path}" if kept else ""))
        return {"compile": self.state, "compile_s": round(seconds, 3), "compile_cache_hits": now["hits"],
                "compile_cache_misses": misses, "autograd_cache_hits": now["autograd_hits"],
                "autograd_cache_bypasses": now["autograd_bypasses"]}

    # -- the file -------------------------------------------------------------------------------------------

    def _supported(self) -> bool:
        if hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts"):
            return True
        if self.enabled:
            log.info(f"note: torch {torch.__version__} cannot keep compile artifacts "
                     f"(no torch.compiler.save_cache_artifacts): every run compiles cold")
            self.enabled = False  # say it once
        return False

    def _read(self) -> bytes | None:
        """The payload of this key's file, or None (absent: silently; bad: with a warning naming why)."""
        try:
            blob = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # none kept yet (a bad folder is said when writing)
            return None
        except OSError as e:
            log.warning(f"cannot read {self.path} ({e.strerror or e}); compiling cold")
            return None
        problem, payload = self._check(blob)
        if problem:
            log.warning(f"ignoring the compile artifacts in {self.path}: {problem}; compiling cold")
            return None
        return payload

    def _check(self, blob: bytes) -> tuple[str | None, bytes]:
        """(what is wrong with a file's bytes, or None; its payload)."""
        if not blob.startswith(MAGIC):
            return "not a dflash compile-artifacts file", b""
        header_line, sep, payload = blob[len(MAGIC):].partition(b"\n")
        try:
            header = json.loads(header_line) if sep else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or not isinstance(header.get("fields"), dict):
            return "its header is unreadable", b""
        theirs = header["fields"]
        differ = sorted(k for k in set(self.fields) | set(theirs) if self.fields.get(k) != theirs.get(k))
        if differ:
            return f"made for another step (differs in {', '.join(differ)})", b""
        if len(payload) != header.get("payload_bytes"):
            return f"the payload is cut short ({len(payload)} of {header.get('payload_bytes')} bytes)", b""
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            return "the payload is corrupt (its sha256 differs from the header's)", b""
        return None, payload

    def _save(self) -> bool:
        """Write what torch compiled in this process under this key; False (with a warning) if it cannot."""
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as e:
            log.warning(f"torch could not serialise the compile artifacts ({type(e).__name__}: {e}); "
                        f"the next run compiles cold too")
            return False
        if saved is None:
            return False  # nothing went through torch's caches
        payload = saved[0]
        header = {"key": self.key, "fields": self.fields, "payload_bytes": len(payload),
                  "payload_sha256": hashlib.sha256(payload).hexdigest()}
        blob = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.path, blob)
        except OSError as e:
            log.warning(f"cannot keep the compile artifacts in {self.path} ({e.strerror or e}); the next run "
                        f"compiles cold too (set DFLASH_CACHE_DIR to a writable folder)")
            return False
        evict(self.path.parent, KEEP)
        return True


def evict(folder: Path, keep: int) -> None:
    """Delete all but the `keep` most recently used artifact files (written or loaded) in `folder`."""
    def used(f: Path) -> float:
        try:
            return f.stat().st_mtime
        except OSError:  # gone meanwhile (another process evicting)
            return float("inf")

    for f in sorted(folder.glob("*.bin"), key=used, reverse=True)[keep:]:
        f.unlink(missing_ok=True)
