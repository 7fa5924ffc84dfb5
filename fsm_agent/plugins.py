"""Middleware plugins: discovered through the entry-point group ``fsm_agent.middleware``.

A plugin package declares, in its ``pyproject.toml``::

    [project.entry-points."fsm_agent.middleware"]
    no_shell = "my_plugins.no_shell:NoShell"

and ``fsm-agent middleware list`` shows it. The built-in plugins (the top-level ``middleware``
package of this distribution) are registered the same way; nothing in ``fsm_agent`` imports
them directly.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from attrs import frozen

from .errors import ConfigurationError
from .middleware import Middleware

__all__ = ["DEFAULT_MIDDLEWARE", "ENTRY_POINT_GROUP", "PluginInfo", "default_middleware", "discover", "load_plugin"]

ENTRY_POINT_GROUP = "fsm_agent.middleware"
DEFAULT_MIDDLEWARE = ("repair", "loop_detection", "repeat_guard")
"""The plugins the CLI puts in every agent's chain: the message-repair passes, loop detection, and
the repeat guard (a side effect the model asks for again is not done twice)."""


@frozen
class PluginInfo:
    """An installed middleware plugin."""

    name: str
    """Entry-point name (what ``load_plugin`` takes)."""
    target: str
    """``module:attribute``."""
    distribution: str
    """The installed distribution that provides it."""


def discover() -> list[PluginInfo]:
    """Every installed plugin, sorted by name."""
    out = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        out.append(PluginInfo(ep.name, ep.value, dist))
    return sorted(out, key=lambda p: p.name)


def default_middleware() -> list[Middleware]:
    """Fresh instances of :data:`DEFAULT_MIDDLEWARE` (those installed), for ``Agent(middleware=...)``."""
    installed = {p.name for p in discover()}
    return [load_plugin(name)() for name in DEFAULT_MIDDLEWARE if name in installed]


def load_plugin(name: str) -> type[Middleware]:
    """The middleware class registered as ``name``.

    Raises:
        ConfigurationError: no such plugin, it fails to import, or it is not a Middleware subclass.
    """
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                obj: Any = ep.load()
            except Exception as exc:  # noqa: BLE001 - report which plugin is broken
                raise ConfigurationError(f"middleware plugin {name!r} ({ep.value}) failed to import: {exc}") from exc
            if not (isinstance(obj, type) and issubclass(obj, Middleware)):
                raise ConfigurationError(f"middleware plugin {name!r} ({ep.value}) is not a Middleware subclass")
            return obj
    known = ", ".join(p.name for p in discover()) or "none installed"
    raise ConfigurationError(f"unknown middleware plugin {name!r}; installed: {known}")
