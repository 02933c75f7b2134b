"""The package's log: one `logging` logger, `dflash` (each module logs to its child, `dflash.<module>`).
The library adds no handler; the `dflash` command does (`setup`): lines go to stderr, written above any tqdm
progress bar, so stdout carries only a command's result (the one JSON document of `--json`). Under torchrun
rank 0 says everything and the other ranks only their warnings, prefixed with their rank.

A command says where it is (`where`), so that a stop (Ctrl-C, SIGTERM) can say where it stopped."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from typing import Callable

from tqdm.auto import tqdm

LOGGER = "dflash"


class _AboveBars(logging.Handler):
    """Writes to the stderr of the moment (a test runner may swap it), through tqdm so a bar stays whole."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _Rank(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK", "0")
        return rank == "0" or record.levelno >= logging.WARNING


def line(record: logging.LogRecord) -> str:
    """A record as the command prints it: `message`, `warning: message`; `[rank N] ...` on ranks other than 0."""
    text = record.getMessage()
    if record.levelno >= logging.WARNING:
        text = f"{record.levelname.lower()}: {text}"
    rank = os.environ.get("RANK", "0")
    return text if rank == "0" else f"[rank {rank}] {text}"


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return line(record)


def setup(level: int = logging.INFO) -> None:
    """Send the package's log lines to stderr (once per process); keep zarr's teardown quiet."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _AboveBars) for h in logger.handlers):
        handler = _AboveBars()
        handler.addFilter(_Rank())
        handler.setFormatter(_Format())
        logger.addHandler(handler)
    logger.setLevel(level)
    quiet_zarr_teardown()


# -- where a command is, for the line a stop prints ---------------------------------------------------------


@contextlib.contextmanager
def where(note: Callable[[], str]):
    """While the block runs, `note()` says where the command is and how it goes on, e.g. "at shard 12 of 40
    (12 committed); run the same command again: it resumes". A KeyboardInterrupt (Ctrl-C, or SIGTERM as the
    `dflash` command raises it) leaving the block carries it as `.where`, computed then, after the block's
    own cleanup (its bars closed, its writes finished); the innermost block's note is the one kept."""
    try:
        yield
    except KeyboardInterrupt as e:
        if getattr(e, "where", None) is None:
            try:
                e.where = note()
            except Exception:  # a note is never worth another traceback
                pass
        raise


def close_bars() -> None:
    """Close every progress bar still open (a stopped command's), so that its last line is the command's."""
    from tqdm import tqdm as std_tqdm

    for bar in list(getattr(std_tqdm, "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


# -- zarr's teardown ---------------------------------------------------------------------------------------

_ZARR = f"{os.sep}zarr{os.sep}"


def _from_zarr(exc: BaseException | None) -> bool:
    tb = exc.__traceback__ if exc is not None else None
    return tb is not None and any(_ZARR in frame.filename for frame in traceback.extract_tb(tb))


class _ZarrLoop(logging.Filter):
    """asyncio's complaints about the tasks of zarr's own event loop. When one chunk write of many fails (a
    full disk), zarr raises that error, which dflash reports in one line, and leaves the others to its loop:
    "Task exception was never retrieved", "Task was destroyed but it is pending!" follow, at exit."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (_ZARR in record.getMessage() or _from_zarr(exc))


def _unraisable(previous):
    def hook(unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)  # a zarr coroutine closed with its loop, at exit
        if code is not None and _ZARR in code.co_filename:
            return
        previous(unraisable)

    hook.dflash = True
    return hook


def quiet_zarr_teardown() -> None:
    """After a failed zarr write the process ends with one line, not zarr's orphaned tasks: asyncio's log
    records about them, the "coroutine ... was never awaited" warnings and the "Exception ignored in" reports
    of their coroutines closed with zarr's loop at exit are dropped (every other record, warning and report
    stays). Once per process."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _ZarrLoop) for f in asyncio_log.filters):
        asyncio_log.addFilter(_ZarrLoop())
    warnings.filterwarnings("ignore", message=r"coroutine 'concurrent_map\.<locals>\.run' was never awaited",
                            category=RuntimeWarning)  # the same filter again replaces the first
    if not getattr(sys.unraisablehook, "dflash", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)
