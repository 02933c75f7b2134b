"""Command-line entry points of the `dflash` distribution (installed as the `dflash_cli` package)."""
