"""MCP tools: the tools of a Model Context Protocol server as fsm_agent tools.

Needs the optional ``mcp`` extra (``pip install "fsm-agent[mcp]"``, the official ``mcp`` 2.x SDK);
``import fsm_agent`` never imports it, and this package imports it only when a toolset is made.

::

    async with mcp_tools(["python", "-m", "my_server"], prefix="fs") as fs:
        agent = Agent(provider, tools=[*fs, my_local_tool])
        result = await agent.run("...")

**Servers.** ``server`` is an ``http(s)://`` URL (Streamable HTTP), a command line as a list of
strings or a ``StdioServerParameters`` (a subprocess spoken to over stdin/stdout), an in-process
``MCPServer`` / low-level ``Server`` (no subprocess), or any ``mcp`` client ``Transport``.

**Lifecycle.** :meth:`MCPToolset.connect` (or ``async with``) starts the server or opens the
connection, performs the MCP handshake and lists the tools once: the tools are a snapshot, with
stable names, so an agent built from them (and a session resumed later with a toolset made the
same way) sees the same tool names. :meth:`MCPToolset.close` ends the connection (and the
subprocess). The connection lives in a task of its own, so ``connect`` and ``close`` may be called
from different tasks, and a transport that fails (a killed server, a dropped HTTP connection)
fails only the calls in flight, as tool errors, never the run that made them. After a lost
connection the next call reconnects (``reconnect=True``). A call that finds the connection closed
before anything was written is sent on the new one whatever its effect; a call that lost its
connection mid-flight is sent once more only if it is ``pure`` or ``idempotent``, never a
``side_effect`` call.

**Mapping** (details and tables in ``docs/mcp.md``):

* ``inputSchema`` → :attr:`~fsm_agent.tools.Tool.parameters`, checked as a JSON Schema (every ``$ref``
  resolved within it: nothing is ever fetched) when the
  toolset connects; every call's arguments are validated before they are sent, so the server never
  sees arguments that break its schema (the model gets the usual ``invalid_arguments`` result).
* annotations → :class:`~fsm_agent.tools.ToolEffect`: ``readOnlyHint`` → ``pure``;
  ``idempotentHint`` → ``idempotent``; anything else, or no annotations → ``side_effect``
  (``effects=`` overrides per tool; ``trust_annotations=False`` ignores the server's hints).
* result ``isError`` → an error tool result carrying the server's content, its text in place of
  any ``structuredContent`` whatever ``prefer_structured`` says
  (:class:`~fsm_agent.errors.ToolError`, ``metadata["error"] == "mcp_tool_error"``).
* an answer that is no ``tools/call`` result (``"result": null``, a list, no ``content`` ...) → an
  error tool result "the server answered with an invalid result: ..." (``mcp_invalid_result``), at
  once: the transport's messages are read on their way to the SDK, which would drop such an
  answer and leave the call waiting for its timeout.
* content: text → :class:`~fsm_agent.types.TextBlock`; image → :class:`~fsm_agent.types.ImageBlock`
  (PNG, JPEG, GIF or WebP, base64, at most 5 MB; else a text note);
  ``structuredContent`` → its JSON as text when there is no content (or always, in place of the
  text blocks, with ``prefer_structured=True``); an
  embedded text resource → its text under a ``[resource <uri>]`` line; an image blob resource → an
  image; other blobs, audio and resource links → a one-line text note; text past
  ``max_result_chars`` (100,000) is cut, with a note.
* every call carries its idempotency key (the same on every resume of the call) as
  ``_meta["fsm-agent/idempotency-key"]``.
* progress notifications → :meth:`~fsm_agent.tools.ToolContext.report_progress` (``ToolProgress``
  events, logged as ``tool_progress``).
* cancelling the call (a Cancel or Interrupt of the run, a timeout) cancels the MCP request: the
  SDK sends ``notifications/cancelled`` (or, in process, cancels the handler directly).

Not supported: server requests to the client (sampling, elicitation, roots), resources and
prompts as tools, and following ``tools/list_changed`` (reconnecting lists the tools again, and a
tool the server no longer offers answers with an error).

The package, by concern: :mod:`.toolset` (:class:`MCPToolset`: options, the connection's lifecycle,
calls), :mod:`.tool` (:class:`MCPTool`: a server tool's name, schema and effect), :mod:`.content`
(:func:`content_blocks`: results as content blocks), :mod:`.answers` (malformed answers told at
once, and what was wrong with them).
"""

from __future__ import annotations

from .content import IMAGE_TYPES, MAX_IMAGE_BYTES, content_blocks
from .tool import MCPTool, effect_from_annotations
from .toolset import DEFAULT_MAX_RESULT_CHARS, IDEMPOTENCY_META_KEY, MCPConnectionError, MCPToolset, mcp_tools

__all__ = ["DEFAULT_MAX_RESULT_CHARS", "IDEMPOTENCY_META_KEY", "IMAGE_TYPES", "MAX_IMAGE_BYTES", "MCPConnectionError",
           "MCPTool", "MCPToolset", "content_blocks", "effect_from_annotations", "mcp_tools"]
