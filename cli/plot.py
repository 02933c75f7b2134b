"""`dflash plot`: a run's loss and tau curves."""

from __future__ import annotations

import click

from dflash_cli.main import user_errors


@click.command(name="plot")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", help="PNG path (default RUN/curves.png).")
@user_errors
def plot(run, out):
    """Draw RUN's loss and tau curves to a PNG."""
    from dflash.plot import plot as draw

    click.echo(f"wrote {draw(run, out)}")
