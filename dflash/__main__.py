"""`python -m dflash ...` is the CLI too (and `torchrun -m dflash extract ...`)."""

from dflash_cli.main import main

if __name__ == "__main__":
    main()
