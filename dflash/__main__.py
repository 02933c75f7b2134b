"""`python -m dflash ...` (and `torchrun -m dflash extract ...`) runs the `dflash` command.

The command lives in the CLI package of this distribution, which the library does not import: it is
looked up as the console script the distribution installs, or, in a checkout put on PYTHONPATH without
installing it (bench/setup_device.sh), by the module name that console script points at.
"""

import importlib
from importlib.metadata import entry_points

CONSOLE_SCRIPT = "dflash_cli.main:main"  # as pyproject.toml's [project.scripts] names it


def command():
    installed = list(entry_points(group="console_scripts", name="dflash"))
    if installed:
        return installed[0].load()
    module, name = CONSOLE_SCRIPT.split(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    command()()
