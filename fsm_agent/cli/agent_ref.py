"""The agent a command serves, named ``MODULE:ATTRIBUTE`` (``--agent``)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..agent import Agent
from ..errors import ConfigurationError

__all__ = ["load_agent"]


def load_agent(spec: str) -> Agent:
    """The Agent at ``module:attribute``: an Agent, or a callable returning one (called with no
    arguments). The working directory is importable, as with ``python -m``.

    Raises:
        ConfigurationError: no ``:``, the module or attribute is missing, or it is not an Agent.
    """
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--agent {spec!r}: use MODULE:ATTRIBUTE, e.g. myapp.agents:support_agent")
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--agent {spec!r}: {exc}") from exc
    if callable(obj) and not isinstance(obj, Agent):
        obj = obj()
    if not isinstance(obj, Agent):
        raise ConfigurationError(f"--agent {spec!r} is not an fsm_agent Agent (got {type(obj).__name__})")
    return obj
