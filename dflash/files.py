"""Small file helpers every writer shares: atomic replacement, sha256 of a file, a full disk as a message."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from dflash.errors import DflashError


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a reader (or a crash) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
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
        detail = f" (writing {full.filename})" if full.filename else ""
        done = committed() if callable(committed) else committed
        raise DflashError(f"{path}: no space left on the device{detail}; {done}; free some space and run the "
                          f"same command again: {then}") from None
