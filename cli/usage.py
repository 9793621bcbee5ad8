"""Usage lines that read as plain usage: ``dmlsearch query [OPTIONS] IMAGE``.

Typer writes a required argument in braces (``{image}``), which reads as a template to fill in rather
than as a name; every command here names its arguments in capitals, as its help text does.
"""

from __future__ import annotations

import typer
from typer._click import Context
from typer.core import TyperArgument, TyperCommand


class PlainUsageCommand(TyperCommand):
    """A command whose usage line names its arguments ``IMAGE``, ``[OUT]`` (optional), ``PATHS...``."""

    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                pieces.append(_usage_name(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


def _usage_name(argument: TyperArgument) -> str:
    if argument.metavar is not None:  # a command that says it itself
        return argument.metavar
    name = (argument.name or "").upper() + ("..." if argument.nargs != 1 else "")
    return name if argument.required else f"[{name}]"


def plain_usage(app: typer.Typer) -> None:
    """Give every command of ``app`` and of its groups a plain usage line (those with a class of their
    own keep it)."""
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = PlainUsageCommand
    for group in app.registered_groups:
        if group.typer_instance is not None:
            plain_usage(group.typer_instance)
