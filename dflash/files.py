"""Small file helpers every writer shares: atomic replacement, safetensors files that follow the umask, sha256
of a file, a full disk as a message."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

from safetensors.torch import load_file, save_file

from dflash.errors import DflashError

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: os.umask can only be read by setting it


def save_tensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, the file's permissions then following the umask as every other file's do
    (safetensors creates it 0600: a teammate could not read a shared cache, run or export). The system's
    refusal (a full disk) is the OSError it is, naming `path`: safetensors reports it as a SafetensorError."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError as e:
        _raise_named(e, path)
    except Exception as e:  # SafetensorError("Error while serializing: I/O error: ... (os error 28)")
        code = _os_errno(e)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e
    os.chmod(path, 0o666 & ~_UMASK)


# how safetensors' Rust side words an I/O error: "(os error 28)" (0.5 on), "Os { code: 28, ... }" (before)
_OS_ERRNO = re.compile(r"os error (\d+)|Os \{ code: (\d+)")


def _os_errno(e: BaseException) -> int | None:
    """The errno an error from a library written in Rust (safetensors) names in its message, if any."""
    m = _OS_ERRNO.search(str(e))
    return int(m.group(1) or m.group(2)) if m else None


def _raise_named(e: OSError, path, *unnamed):
    """Raise `e` (being handled), as naming `path` if it names no file or one of `unnamed` (a temporary file of
    ours): a failed write() (ENOSPC) names none."""
    if e.errno is None or (e.filename is not None and str(e.filename) not in map(str, unnamed)):
        raise e
    raise OSError(e.errno, e.strerror, str(path)) from e


def load_tensors(path, what: str = "") -> dict:
    """A safetensors file's tensors; a missing, cut or foreign file is one line naming it (`what` in front)."""
    where = f"{what} {path}".strip()
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise DflashError(f"{where}: missing") from None
    except Exception as e:  # SafetensorError (a cut or foreign file), OSError
        raise DflashError(f"{where}: unreadable safetensors file ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def held(folder: Path, what: str):
    """Hold `folder` for this process (an advisory lock on folder/.lock, which the kernel releases when the
    process ends, SIGKILL included): a second process is refused with one line naming the holder."""
    import fcntl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise DflashError(f"{folder}: {holder} is using this {what}; wait for it to end or use another "
                              f"folder") from None
        f.seek(0)
        f.truncate()
        f.write(f"dflash (pid {os.getpid()})")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)  # the kernel drops the lock with the file


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a reader (or a crash) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        _raise_named(e, path, tmp)
    finally:
        tmp.unlink(missing_ok=True)  # only left behind when the write failed


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: Path, obj, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _disk_full(e: BaseException) -> OSError | None:
    """The ENOSPC (or EDQUOT) error in `e`'s chain of causes, if any (libraries sometimes wrap it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e = e.__cause__ or e.__context__
    return None


# zarr writes a file as its name with the suffix replaced by .<uuid hex>.partial, then renames it
_ZARR_TEMPORARY = re.compile(r"\.[0-9a-f]{32}\.partial$")


def _shown(filename) -> str:
    """The file a write was for: zarr's temporary name for it is shown as the file's own (a chunk's key has
    no suffix; its metadata is zarr.json)."""
    name = os.fsdecode(filename)
    if not _ZARR_TEMPORARY.search(name):
        return name
    name = _ZARR_TEMPORARY.sub("", name)
    return name + ".json" if Path(name).name == "zarr" else name


def disk_full_line(e: BaseException) -> str | None:
    """The one line a full disk met by a writer without its own account (`disk_full_is_an_error`) ends its
    command with: the file, when known; None when `e` is no full disk."""
    full = _disk_full(e)
    if full is None:
        return None
    detail = f" (writing {_shown(full.filename)})" if full.filename else ""
    return f"no space left on the device{detail}; free some space and run the same command again"


@contextlib.contextmanager
def disk_full_is_an_error(path, committed: str | Callable[[], str], then: str = "it resumes"):
    """A full disk inside the block becomes one line (a DflashError) that names `path` and the file being
    written, says what is committed (`committed`, or what it returns, computed only then) and that the same
    command run again `then`."""
    try:
        yield
    except DflashError:
        raise
    except BaseException as e:
        full = _disk_full(e)
        if full is None:
            raise
        detail = f" (writing {_shown(full.filename)})" if full.filename else ""
        done = committed() if callable(committed) else committed
        raise DflashError(f"{path}: no space left on the device{detail}; {done}; free some space and run the "
                          f"same command again: {then}") from None
