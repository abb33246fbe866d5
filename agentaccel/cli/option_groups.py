"""Options declared once, as a dataclass's fields, and received whole: a command with many options
(`serve`) takes one typed object instead of forty arguments it would pass on one by one."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing


def receives(group: type, name: str, make=None):
    """A decorator: the command's own parameters, except `name`, plus one option per field of the
    dataclass `group` (each field annotated with its `typer.Option`); the command is called with
    those options gathered into one `group` in its argument `name` (or what `make` makes of it)."""
    hints = typing.get_type_hints(group, include_extras=True)
    fields = dataclasses.fields(group)

    def decorate(command):
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != name]
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                   default=f.default) for f in fields]

        @functools.wraps(command)
        def gathered(*args, **options):
            values = {f.name: options.pop(f.name) for f in fields}
            gathered_options = group(**values)
            return command(*args, **{name: make(gathered_options) if make else gathered_options}, **options)

        gathered.__signature__ = inspect.Signature(own + added)
        gathered.__annotations__ = {p.name: p.annotation for p in own + added}
        return gathered

    return decorate
