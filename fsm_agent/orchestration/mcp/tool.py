"""An MCP server's tool as an fsm_agent :class:`~fsm_agent.tools.Tool`: its name (prefix, characters
the providers allow), its ``inputSchema`` as the checked parameters, its annotations as a
:class:`~fsm_agent.tools.ToolEffect`, and a call that goes through its toolset."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import ToolDefinitionError
from ...tools.registry import Tool, ToolContext, ToolEffect

if TYPE_CHECKING:
    from mcp.types import Tool as MCPToolSpec

__all__ = ["MCPTool", "NAME_RULE", "PREFIX_RULE", "Toolset", "effect_from_annotations", "local_name"]

NAME_RULE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""What an fsm_agent name given for a server tool (``MCPToolset(names=)``) must match."""
PREFIX_RULE = re.compile(r"^[a-zA-Z0-9_-]{1,32}$")
"""What ``MCPToolset(prefix=)`` must match."""
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_-]")
_CONTEXT_PARAM = "_fsm_agent_tool_context"


class Toolset(Protocol):
    """What an :class:`MCPTool` needs of the toolset it calls through
    (:class:`~fsm_agent.orchestration.mcp.MCPToolset`): its name for messages, and the call."""

    @property
    def name(self) -> str:
        """What messages call the server."""
        ...

    async def _call(self, tool: MCPTool, arguments: dict[str, Any], ctx: ToolContext) -> Any: ...


def effect_from_annotations(annotations: Any, *, trust: bool = True) -> ToolEffect:
    """The :class:`~fsm_agent.tools.ToolEffect` of an MCP tool from its ``ToolAnnotations`` (or ``None``).

    ``readOnlyHint`` true → ``pure``; else ``idempotentHint`` true → ``idempotent``; else
    ``side_effect`` (the MCP defaults: not read-only, possibly destructive, not idempotent). With
    ``trust=False`` every tool is ``side_effect``: the MCP specification says hints from an
    untrusted server must not drive decisions, and ``side_effect`` is the one effect a resume never
    repeats silently.
    """
    if not trust or annotations is None:
        return ToolEffect.SIDE_EFFECT
    if getattr(annotations, "read_only_hint", None) is True:
        return ToolEffect.PURE
    if getattr(annotations, "idempotent_hint", None) is True:
        return ToolEffect.IDEMPOTENT
    return ToolEffect.SIDE_EFFECT


def local_name(prefix: str | None, remote: str) -> str:
    """``prefix_remote`` with characters outside ``[a-zA-Z0-9_-]`` made ``_``; past 64 characters,
    cut and given 8 hex digits of the remote name's SHA-256 (stable across runs and processes)."""
    name = _NOT_IN_NAME.sub("_", remote)
    if prefix:
        name = f"{prefix}_{name}"
    if len(name) > 64:
        name = name[:55] + "_" + hashlib.sha256(remote.encode()).hexdigest()[:8]
    return name


class MCPTool(Tool):
    """An fsm_agent :class:`~fsm_agent.tools.Tool` that calls one tool of an MCP server.

    Made by :class:`MCPToolset`; call-compatible with every other tool (validation, ledger,
    policy, approvals). The MCP call's own deadline is :attr:`call_timeout` (the inherited
    :attr:`~fsm_agent.tools.Tool.timeout` is ``None`` so that the MCP-specific timeout error, which
    says the request was cancelled on the server, is the one the model reads; a run's
    ``RunConfig.tool_timeout`` still applies on top).
    """

    __slots__ = ("annotations", "call_timeout", "output_schema", "remote_name", "title", "toolset")

    def __init__(self, toolset: Toolset, spec: MCPToolSpec, *, name: str, effect: ToolEffect,
                 call_timeout: float | None) -> None:
        self.toolset = toolset
        """The toolset (and connection) the tool calls through."""
        self.remote_name = spec.name
        """The tool's name on the server (what is sent in ``tools/call``)."""
        self.title = spec.title or (spec.annotations.title if spec.annotations else None)
        """The server's human-readable title, or ``None``."""
        self.annotations = spec.annotations
        """The server's ``ToolAnnotations`` (hints), or ``None``."""
        self.output_schema = spec.output_schema
        """The server's ``outputSchema`` (JSON Schema of ``structuredContent``), or ``None``."""
        self.call_timeout = call_timeout
        """Seconds one call may take before the MCP request is cancelled; ``None``: no limit."""
        if not spec.name:  # with a prefix it would become a valid name ('fs_') of nothing the server can call
            raise ToolDefinitionError(f"MCP server {toolset.name!r} lists a tool without a name; exclude it with "
                                      "exclude=['']")
        parameters = dict(spec.input_schema)  # the SDK has checked that its root is type 'object'
        if _CONTEXT_PARAM in (parameters.get("properties") or {}):
            raise ToolDefinitionError(f"MCP tool {spec.name!r} of {toolset.name!r}: a parameter is named "
                                      f"{_CONTEXT_PARAM!r}, which fsm_agent reserves; exclude the tool")
        this = self

        async def call(_fsm_agent_tool_context: ToolContext, **arguments: Any) -> Any:
            return await toolset._call(this, arguments, _fsm_agent_tool_context)

        description = spec.description or self.title or ""
        try:
            super().__init__(call, name=name, description=description, parameters=parameters, timeout=None,
                             effect=effect)
        except ToolDefinitionError as exc:
            raise ToolDefinitionError(f"MCP tool {spec.name!r} of {toolset.name!r}: {exc}") from exc

    def __repr__(self) -> str:
        return (f"MCPTool(name={self.name!r}, server={self.toolset.name!r}, remote_name={self.remote_name!r}, "
                f"effect={self.effect.value!r}, call_timeout={self.call_timeout!r})")
