"""The one converter (cattrs + orjson) for every fsm_agent type.

Unions are tagged: content blocks and stream/observer events by ``"type"``,
messages by ``"role"``; the tag is each class's ``TAG``/``ROLE``. Nothing else
in fsm_agent builds a converter.

    >>> from fsm_agent.types import UserMessage, dumps, loads, Message
    >>> loads(dumps(UserMessage("hi")), Message) == UserMessage("hi")
    True
"""

from __future__ import annotations

import typing
from typing import Any, TypeVar

import orjson
from cattrs.preconf.orjson import make_converter
from cattrs.strategies import configure_tagged_union

from .content import ContentBlock
from .events import ObserverEvent
from .messages import Message
from .stream import StreamEvent

__all__ = ["converter", "dumps", "loads", "structure", "unstructure"]

T = TypeVar("T")

converter = make_converter()
"""The shared cattrs converter (orjson flavour)."""

def _tag(cl: type) -> str:
    return str(getattr(cl, "TAG"))  # noqa: B009 - ClassVar of every tagged class


def _role(cl: type) -> str:
    return str(getattr(cl, "ROLE"))  # noqa: B009


configure_tagged_union(ContentBlock, converter, tag_generator=_tag, tag_name="type")
configure_tagged_union(Message, converter, tag_generator=_role, tag_name="role")
configure_tagged_union(StreamEvent, converter, tag_generator=_tag, tag_name="type")
configure_tagged_union(ObserverEvent, converter, tag_generator=_tag, tag_name="type")


_UNION_OF: dict[type, Any] = {}
for _union in (ContentBlock, Message, StreamEvent, ObserverEvent):
    for _member in typing.get_args(_union):
        _UNION_OF.setdefault(_member, _union)


def unstructure(obj: Any, as_type: Any = None) -> Any:
    """``obj`` as JSON-ready builtins (dicts, lists, str, numbers).

    A block, message or event is tagged (``"type"`` / ``"role"``) even when
    passed on its own, so it loads back through its union.
    """
    if as_type is None:
        as_type = _UNION_OF.get(type(obj))
    return converter.unstructure(obj, as_type) if as_type is not None else converter.unstructure(obj)


def structure(data: Any, cl: type[T] | Any) -> T:
    """Builtins back into ``cl`` (a class or a union such as ``Message``)."""
    result: T = converter.structure(data, cl)
    return result


def dumps(obj: Any, as_type: Any = None) -> bytes:
    """``obj`` as JSON bytes."""
    return orjson.dumps(unstructure(obj, as_type))


def loads(data: bytes | str, cl: type[T] | Any) -> T:
    """JSON back into ``cl``."""
    result: T = structure(orjson.loads(data), cl)
    return result
