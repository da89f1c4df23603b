"""Command lines from the config dataclasses: one source for every setting.

``config_options(WorkerConfig)`` turns a function ``f(config: WorkerConfig, ...)`` into a
typer command with one ``--option`` per field (``--heartbeat-interval-s``), each with the
field's default and its docstring as ``--help``; ``to_argv(config)`` writes the arguments
that reproduce a config, for the child processes a parent starts (``worker --gpus 0,1``,
``LocalCluster``). Both read the dataclass, so a new field reaches the command line and the
children without another edit (tests/unit/test_settings.py round-trips every field).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (read from its source), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional_of(annotation: Any) -> Any | None:
    """``X`` for ``X | None`` / ``Optional[X]``, else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0]
    return None


def to_argv(config: Any) -> list[str]:
    """Command-line arguments that reproduce ``config`` exactly (every field, none left to a
    default). A field that is None is left out: every optional field defaults to None."""
    argv: list[str] = []
    hints = _field_types(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            if f.default is not None:
                raise ValueError(f"{type(config).__name__}.{f.name} is None but defaults to {f.default!r}")
            continue
        if hints[f.name] is bool:
            argv.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        else:
            argv += [flag(f.name), repr(value) if isinstance(value, float) else str(value)]
    return argv


def config_options(cls: type, *, required: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Decorate ``f(config: cls, **rest)`` into a typer command taking each field of ``cls``
    as an option (``required`` ones without a default; ``skip`` ones left at their default)."""
    import typer

    hints = _field_types(cls)
    docs = field_docs(cls)

    def decorate(func: F) -> F:
        own = [p for p in inspect.signature(func).parameters.values() if p.name != "config"]
        own_hints = typing.get_type_hints(func)
        params: list[inspect.Parameter] = []
        names = []
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            names.append(f.name)
            annotation = hints[f.name]
            inner = _optional_of(annotation)
            default = ... if f.name in required else f.default
            decls = [f"{flag(f.name)}/--no-{flag(f.name)[2:]}"] if annotation is bool else [flag(f.name)]
            option = typer.Option(default, *decls, help=docs.get(f.name, ""), show_default=default is not None)
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=option,
                    annotation=typing.Optional[inner] if inner is not None else annotation,  # noqa: UP045
                )
            )
        keyword = inspect.Parameter.KEYWORD_ONLY
        params += [p.replace(kind=keyword, annotation=own_hints.get(p.name, p.annotation)) for p in own]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            try:
                config = cls(**{name: kwargs.pop(name) for name in names})
            except ValueError as exc:  # a setting out of range: a usage error, not a traceback
                raise typer.BadParameter(str(exc)) from None
            return func(config, **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the new signature, not the function's
        return command  # type: ignore[return-value]

    return decorate
