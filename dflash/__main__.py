"""`python -m dflash ...` (and `torchrun -m dflash extract ...`) runs the `dflash` command.

The command lives in the CLI package of this distribution, which the library does not import: it is
found through the console script the distribution installs.
"""

from importlib.metadata import entry_points

if __name__ == "__main__":
    (command,) = entry_points(group="console_scripts", name="dflash")
    command.load()()
