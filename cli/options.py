"""Click options generated from the config dataclasses (`dflash.config`): one option per field (a nested
config's fields flattened in: `option_fields`), named after
it (`token_budget` -> `--token-budget`), typed by its hint (`Literal[...]` -> a choice, `list[int]` -> a
comma list, `list[str]` -> a repeatable option, `bool` -> a flag; `--x/--no-x` when it is on by default),
its docstring as the help text and its default as the shown default.

Every generated option defaults to None, so that only the options given on the command line override the
preset's table (`--config`); the dataclass then fills in the rest.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Literal

import click

from dflash.config import field_docs, option, option_fields, type_hints


class IntList(click.ParamType):
    """A comma-separated list of integers, e.g. 1,9,17."""

    name = "ints"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            self.fail(f"expected comma-separated integers such as 1,9,17, got {value!r}", param, ctx)


def config_options(cls: type, section: str):
    """Decorator: `--config PRESET` (passed as `preset`) and an option for every field of `cls`."""

    def decorate(fn):
        for owner, f in reversed(option_fields(cls).values()):  # click lists options in the order declared
            fn = click.option(_decl(f), **_option_kwargs(f, type_hints(owner)[f.name],
                                                        field_docs(owner).get(f.name, "")))(fn)
        return click.option("--config", "preset", type=click.Path(dir_okay=False),
                            help=f"TOML preset; its [{section}] table gives defaults, options override it.")(fn)

    return decorate


def field_option(cls: type, name: str):
    """One field of `cls` as an option of a command that takes no preset: the field's default is the option's."""
    owner, f = option_fields(cls)[name]
    kwargs = _option_kwargs(f, type_hints(owner)[name], field_docs(owner).get(name, ""))
    return click.option(_decl(f), **{**kwargs, "default": f.default})


def _decl(f: dataclasses.Field) -> str:
    """The option's name; a flag that is on by default comes with its off switch: `--x/--no-x`."""
    name = option(f.name)
    return f"{name}/--no-{name[2:]}" if f.default is True else name


def _option_kwargs(f: dataclasses.Field, hint, doc: str) -> dict:
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint  # X | None -> X
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    shown = "" if default is None or default is False or default in ([], "") else f"  [default: {default}]"
    kwargs = {"default": None, "help": doc + shown}
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        kwargs["type"] = click.Choice(args)
    elif origin is list:
        if args[0] is int:
            kwargs["type"] = IntList()
        else:
            kwargs.update(multiple=True, help=f"{doc} Repeatable; replaces the preset's list.{shown}")
    elif kind is bool:
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = kind
    return kwargs
