"""What crosses the line between a session's workflow and its activities: JSON-ready forms.

Temporal's payload converter carries JSON. Values go through fsm_agent's one converter
(:mod:`fsm_agent.types.codec`); an exception raised by an activity (a provider's error, a tool's
:class:`~fsm_agent.errors.SuspendCall`) travels as its class and its attributes and is rebuilt, the
same object type, on the workflow's side, so the engine handles it exactly as in process.
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Any

import attrs
import orjson

from ..types.codec import structure, unstructure

__all__ = ["exception_form", "exception_of", "form", "message_digest", "value_of"]

_ATTRS = "__attrs__"


def message_digest(message_form: Any) -> str:
    """The content hash that names a message's form across the workflow-activity line."""
    return hashlib.sha256(orjson.dumps(message_form, option=orjson.OPT_SORT_KEYS)).hexdigest()


def form(value: Any) -> Any:
    """``value`` as JSON-ready builtins; an attrs value keeps its class so :func:`value_of` rebuilds it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [form(v) for v in value]
    if isinstance(value, dict):
        return {str(k): form(v) for k, v in value.items()}
    if attrs.has(type(value)):
        cls = type(value)
        return {_ATTRS: f"{cls.__module__}:{cls.__qualname__}", "form": unstructure(value)}
    return repr(value)


def value_of(data: Any) -> Any:
    """The value :func:`form` made."""
    if isinstance(data, list):
        return [value_of(v) for v in data]
    if isinstance(data, dict):
        if _ATTRS in data and "form" in data and len(data) == 2:
            return structure(data["form"], _class(data[_ATTRS]))
        return {k: value_of(v) for k, v in data.items()}
    return data


def _class(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module.startswith("fsm_agent"):  # only our own types are rebuilt from a payload
        raise ValueError(f"refusing to rebuild {path!r} from a payload")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def exception_form(exc: BaseException) -> dict[str, Any]:
    """An fsm_agent exception as its class, args and attributes (JSON-ready)."""
    cls = type(exc)
    return {"type": f"{cls.__module__}:{cls.__qualname__}", "args": form(list(exc.args)),
            "state": {k: form(v) for k, v in vars(exc).items() if not k.startswith("__")}}


def exception_of(data: dict[str, Any]) -> BaseException:
    """The exception :func:`exception_form` described (built without calling its ``__init__``); one
    that is not fsm_agent's comes back as a :class:`RuntimeError` naming its type and message."""
    try:
        cls = _class(data["type"])
    except (ValueError, ImportError, AttributeError):
        return RuntimeError(f"{data['type']}: {', '.join(map(str, data.get('args') or []))}")
    exc: BaseException = cls.__new__(cls)
    exc.args = tuple(value_of(data.get("args") or []))
    for k, v in (data.get("state") or {}).items():
        setattr(exc, k, value_of(v))
    return exc
