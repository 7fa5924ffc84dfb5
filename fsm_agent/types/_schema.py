"""JSON Schema validators that never fetch a document (shared by tool schemas and output schemas).

jsonschema, given no registry, fetches a ``$ref`` to ``http(s)://`` with a blocking ``urlopen`` (no
timeout) while it validates: a schema from an untrusted place (an MCP server's ``inputSchema``)
could make the agent request any URL, from inside the event loop. Here references resolve
within the schema itself and the JSON Schema dialects' own meta-schemas only, and
:func:`check_refs` resolves every one of them up front, so a bad reference is found when the
schema is given, never while a value is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["UnresolvedRef", "check_refs", "offline_validator"]

_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


class UnresolvedRef(ValueError):
    """A reference of a schema that does not resolve within it (callers re-raise their own error)."""


def offline_validator(cls: Any, schema: Any) -> Any:
    """A validator of jsonschema validator class ``cls`` for ``schema`` whose registry cannot
    retrieve anything (jsonschema adds the dialects' meta-schemas to it)."""
    from referencing import Registry

    return cls(schema, registry=Registry())


def check_refs(schema: Any) -> None:
    """Resolve every ``$ref`` / ``$dynamicRef`` / ``$recursiveRef`` of ``schema`` (its ``$schema``
    dialect, else draft 2020-12), each against the base URI it sits under.

    Raises:
        UnresolvedRef: one does not resolve (names it).
        RecursionError: the schema is nested too deeply to walk.
    """
    import jsonschema_specifications  # type: ignore[import-untyped]
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    root = Resource.from_contents(schema, default_specification=DRAFT202012)
    _walk(jsonschema_specifications.REGISTRY.combine(Registry()).resolver_with_root(root), root)


def _walk(resolver: Any, resource: Any) -> None:
    from referencing.exceptions import Unresolvable

    contents = resource.contents
    if isinstance(contents, Mapping):
        for keyword in _REF_KEYWORDS:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except Unresolvable as exc:
                raise UnresolvedRef(
                    f"JSON Schema {keyword} {ref[:200]!r} does not resolve within the schema; references must point "
                    "into the schema itself ('#/$defs/...') or to a JSON Schema meta-schema: other documents are "
                    "never fetched") from exc
    for sub in resource.subresources():
        _walk(resolver.in_subresource(sub), sub)
