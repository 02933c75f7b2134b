"""The `dflash` command: a click group; each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading

import click

from dflash import logs
from dflash.errors import DflashError

# a stop's exit status, as a shell reports a process ended by the signal: 128 + its number
STOP_EXIT = {signal.SIGINT: 128 + signal.SIGINT, signal.SIGTERM: 128 + signal.SIGTERM}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: the command stops the same way
    (its `finally` blocks run: bars closed, the writes in flight finished, partial files removed)."""

    signal = signal.SIGTERM


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def _fail(line: str, code: int) -> None:
    logs.close_bars()  # the line is the last
    click.echo(f"{_rank_prefix()}{line}", err=True)
    sys.exit(code)


def user_errors(fn):
    """Turn a DflashError (or a full disk) into one line on stderr and exit 1, with no traceback. A stop (Ctrl-C,
    SIGTERM) is one line too, the last: where the command stopped (`logs.where`); exit 130 (SIGINT) or 143
    (SIGTERM)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            _fail(f"error: {e}", 1)
        except Exception as e:  # a full disk under a writer that does not say it itself (plot, spec --save-outputs)
            from dflash.files import disk_full_line

            line = disk_full_line(e)
            if line is None:
                raise
            _fail(f"error: {line}", 1)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signal", signal.SIGINT)
            where = getattr(e, "where", None)
            _fail(f"stopped by {signum.name}" + (f" {where}" if where else ""), STOP_EXIT[signum])
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters from an offline hidden-state cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logs.setup()  # dflash's log lines to stderr: stdout is for results (the JSON of --json)


def _register():
    from dflash_cli import cache, demo, eval, export, extract, plot, regenerate, spec, train

    main.add_command(extract.extract)
    main.add_command(train.train)
    main.add_command(export.export)
    main.add_command(eval.evaluate)
    main.add_command(plot.plot)
    main.add_command(spec.spec)
    main.add_command(regenerate.regenerate)
    main.add_command(cache.cache)
    main.add_command(demo.demo)


_register()
