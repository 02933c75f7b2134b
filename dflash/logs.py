"""The package's log: one `logging` logger, `dflash` (each module logs to its child, `dflash.<module>`).
The library adds no handler; the `dflash` command does (`setup`): lines go to stderr, written above any tqdm
progress bar, so stdout carries only a command's result (the one JSON document of `--json`). Under torchrun
rank 0 says everything and the other ranks only their warnings, prefixed with their rank."""

from __future__ import annotations

import logging
import os
import sys

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
    """Send the package's log lines to stderr (once per process)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _AboveBars) for h in logger.handlers):
        handler = _AboveBars()
        handler.addFilter(_Rank())
        handler.setFormatter(_Format())
        logger.addHandler(handler)
    logger.setLevel(level)
