"""Command-line flags generated from a pydantic settings model: one flag per field, declared nowhere else.

A field's name gives the flag (``max_k`` -> ``--max-k``), its type the flag's type, its description the
help, its default the shown default and its ``ge``/``le`` bounds the flag's range; a ``bool`` becomes a
``--x/--no-x`` pair, a ``list`` a repeatable flag and a secret a plain string (better set in the
environment: flags show in ``ps``). A flag left out keeps the environment's value, then the field's default,
because only the flags given are passed to the model. So a field added to ``app/settings.py`` is a
``dmlsearch serve`` flag at once.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
import typer
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from cli.common import fail


def settings_flags(
    settings_type: type[BaseSettings], aliases: Mapping[str, tuple[str, ...]] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a Typer command one flag per field of ``settings_type``.

    The command declares a ``settings`` parameter and receives the validated settings there (flags over
    the environment over the defaults); invalid values are CLI errors (exit code 2). ``aliases``: extra
    flag names per field, e.g. the shorter names earlier versions used.
    """
    aliases = aliases or {}
    prefix = settings_type.model_config.get("env_prefix", "")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "settings"]
        fields = settings_type.model_fields
        clash = {p.name for p in own} & set(fields)
        if clash:
            raise TypeError(f"{command.__name__} parameters {sorted(clash)} shadow settings fields")
        flags = [
            _flag(name, field, aliases.get(name, ()), f"{prefix}{name}".upper())
            for name, field in fields.items()
        ]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            given = {name: values.pop(name) for name in fields}
            try:
                settings = settings_type(**{name: v for name, v in given.items() if v is not None})
            except ValidationError as err:
                raise fail(f"invalid settings: {_describe(err, prefix)}") from None
            return command(settings=settings, **values)

        parameters = [*own, *flags]
        # What Typer reads the options from (a function declares no __signature__ to a type checker).
        run.__dict__["__signature__"] = signature.replace(parameters=parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate


def _flag(name: str, field: FieldInfo, aliases: tuple[str, ...], env: str) -> inspect.Parameter:
    value_type = _cli_type(field.annotation)
    flag = "--" + name.replace("_", "-")
    declarations = [f"{flag}/--no-{flag[2:]}"] if value_type is bool else [flag, *aliases]
    default = field.get_default(call_default_factory=True)
    low: float | None = None
    high: float | None = None
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge) and isinstance(rule.ge, int | float):
            low = rule.ge
        elif isinstance(rule, annotated_types.Gt) and value_type is int and isinstance(rule.gt, int):
            low = rule.gt + 1
        elif isinstance(rule, annotated_types.Le) and isinstance(rule.le, int | float):
            high = rule.le
    description = field.description or name.replace("_", " ")
    help_text = f"{description[0].upper()}{description[1:]} (env {env})."
    if _unwrap_optional(field.annotation) is SecretStr:
        help_text += " Prefer the variable: flags show in ps."
    if default not in (None, []):
        # In the help text, not as show_default: Click puts a string show_default in parentheses, and the
        # flag's own default must stay None so that the environment applies.
        help_text += f"  [default: {default}]"
    option = typer.Option(*declarations, help=help_text, show_default=False, min=low, max=high)
    # None = not given: the environment's value or the field's default applies.
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[value_type | None, option]
    )


def _unwrap_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        (inner,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        return inner
    return annotation


def _cli_type(annotation: Any) -> Any:
    """The type a flag parses into: secrets are typed as plain strings, ``Annotated`` extras dropped."""
    inner = _unwrap_optional(annotation)
    if get_origin(inner) is Annotated:
        inner = get_args(inner)[0]
    return str if inner is SecretStr else inner


def _describe(err: ValidationError, prefix: str) -> str:
    """``field (--flag, ENV_VAR): message`` for each refused value."""
    parts = []
    for error in err.errors():
        name = str(error["loc"][0]) if error["loc"] else "settings"
        parts.append(f"{name} (--{name.replace('_', '-')}, {prefix.upper()}{name.upper()}): {error['msg']}")
    return "; ".join(parts)
