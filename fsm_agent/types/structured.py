"""The declared shape of a model's answer (issue 8 §5: structured output).

An :class:`OutputSchema` on a :class:`~fsm_agent.types.MessageRequest` asks the
model for one JSON value that matches a JSON Schema. Each protocol sends it in
the provider's own format (Chat ``response_format``, Responses ``text.format``,
Anthropic ``output_config.format``); where the server has none, the provider
falls back (see :meth:`fsm_agent.providers.HttpProvider.prepare`).
:func:`fsm_agent.structured.parse_output` checks the answer against it.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import field, frozen

from ..errors import ConfigurationError
from ._schema import UnresolvedRef, check_refs

__all__ = ["OutputSchema"]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _check_name(_: object, __: object, value: str) -> None:
    if not _NAME.match(value):
        raise ConfigurationError(f"output schema name {value!r} must match {_NAME.pattern}")


def _check_schema(_: object, __: object, value: dict[str, Any]) -> None:
    """The schema must be a valid JSON Schema (checked here, before any model is called)."""
    if not isinstance(value, dict):
        raise ConfigurationError(f"an output schema must be a JSON Schema object (a dict), not {type(value).__name__}")
    import jsonschema  # imported with the first OutputSchema, not with fsm_agent

    cls = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(value)
        check_refs(value)  # no reference is ever fetched: each must resolve within the schema
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ConfigurationError(f"invalid output JSON Schema at {where}: {exc.message}") from None
    except UnresolvedRef as exc:
        raise ConfigurationError(f"invalid output JSON Schema: {exc}") from None
    except RecursionError:
        raise ConfigurationError("invalid output JSON Schema: nested too deeply to be checked") from None


@frozen
class OutputSchema:
    """A JSON Schema the answer must match, with the name providers ask for.

        >>> OutputSchema("city", {"type": "object", "properties": {"name": {"type": "string"}},
        ...                       "required": ["name"], "additionalProperties": False}).response_format()["type"]
        'json_schema'
    """

    name: str = field(validator=_check_name)
    """``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI's rule; also the forced-tool name on Anthropic)."""
    schema: dict[str, Any] = field(factory=lambda: {"type": "object"}, validator=_check_schema)
    """JSON Schema (draft 2020-12) of the answer."""
    description: str = ""
    """What the answer is, for the model; sent where the protocol has a place for it."""
    strict: bool = True
    """OpenAI strict mode: the server guarantees the schema, but then every object needs
    ``"additionalProperties": false`` and every property listed in ``required``. Set ``False`` for
    a schema that does not follow those rules (the server follows it best-effort, and the answer
    is still checked by :func:`fsm_agent.structured.parse_output`)."""

    def response_format(self) -> dict[str, Any]:
        """The Chat Completions ``response_format`` for this schema."""
        js: dict[str, Any] = {"name": self.name, "schema": self.schema, "strict": self.strict}
        if self.description:
            js["description"] = self.description
        return {"type": "json_schema", "json_schema": js}
