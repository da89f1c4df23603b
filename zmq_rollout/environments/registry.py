"""Environments by name: Python entry points of the group ``zmq_rollout.environments``.

A package makes its environment available to every trainer by declaring, in its
``pyproject.toml``::

    [project.entry-points."zmq_rollout.environments"]
    my_env = "my_package.envs:MyEnvironment"

The target is a class or a function; called with the keyword arguments given to
``run_episodes(env_kwargs=...)``, it returns an ``Environment`` or a ``MultiTurnScheduler``
(a new one per episode). ``register`` adds one in-process (tests, notebooks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from zmq_rollout.errors import ConfigError

from .base import Environment, MultiTurnScheduler, SchedulerEnvironment

GROUP = "zmq_rollout.environments"

Factory = Callable[..., Environment | MultiTurnScheduler]
_registered: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Make ``factory`` available as ``name`` in this process (before the entry points)."""
    if not name or not isinstance(name, str):
        raise ConfigError("an environment name is a non-empty string")
    _registered[name] = factory


@functools.cache
def _installed() -> frozenset[str]:
    return frozenset(ep.name for ep in entry_points(group=GROUP))


def available() -> list[str]:
    """Names of the environments this process can build: registered here or installed (the
    installed ones are read once per process)."""
    return sorted(set(_registered) | _installed())


def factory(name: str) -> Factory:
    """The factory registered as ``name``; ``ConfigError`` naming the choices if none."""
    if name in _registered:
        return _registered[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            try:
                loaded: Factory = ep.load()
            except Exception as exc:  # an installed plugin that fails to import
                raise ConfigError(f"environment {name!r} ({ep.value}) failed to load: {exc}") from exc
            return loaded
    raise ConfigError(f"no environment named {name!r}; available: {', '.join(available()) or 'none'}")


def build(env: str | Factory, kwargs: dict[str, Any] | None = None) -> Environment:
    """A new ``Environment`` for one episode from a name or a factory."""
    made = (factory(env) if isinstance(env, str) else env)(**(kwargs or {}))
    if isinstance(made, MultiTurnScheduler):
        return SchedulerEnvironment(made)
    if not isinstance(made, Environment):
        raise ConfigError(
            f"environment factory {env!r} returned {type(made).__name__}, not an Environment or MultiTurnScheduler"
        )
    return made
