"""The toolset of one MCP server: its options, the connection's lifecycle (connect, the task that
owns the SDK session, close, reconnect after a lost connection) and each call (sent once, or once
more when a lost connection cannot have mattered; failures mapped to error results the model reads).
The behaviour is described in the package docstring."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from ...errors import ConfigurationError, ToolDefinitionError, ToolError
from ...tools.registry import DEFAULT_TOOL_TIMEOUT, ToolContext, ToolEffect
from .answers import CheckedTransport, invalid_answer
from .content import result_value
from .tool import NAME_RULE, PREFIX_RULE, MCPTool, effect_from_annotations, local_name

if TYPE_CHECKING:
    from mcp import Client
    from mcp.types import CallToolResult, RequestParamsMeta
    from mcp.types import Tool as MCPToolSpec

__all__ = ["DEFAULT_MAX_RESULT_CHARS", "IDEMPOTENCY_META_KEY", "MCPConnectionError", "MCPToolset", "mcp_tools"]

log = logging.getLogger(__package__)  # "fsm_agent.orchestration.mcp", as before the package

_INSTALL = 'pip install "fsm-agent[mcp]"'
_LIST_PAGES = 100
"""At most this many ``tools/list`` pages are read (a paginating server that never ends cannot hang connect)."""
_CLOSE_WAIT = 10.0
"""Seconds :meth:`MCPToolset.close` waits for the transport to shut down before cancelling it."""
DEFAULT_MAX_RESULT_CHARS = 100_000
"""``MCPToolset(max_result_chars=)``'s default: the text of one result the model reads at most."""
IDEMPOTENCY_META_KEY = "fsm-agent/idempotency-key"
"""The ``_meta`` key of every ``tools/call``: the call's idempotency key (the same on every resume of
the same call), for a server that makes repeats harmless."""


class MCPConnectionError(ConfigurationError, ConnectionError):
    """The MCP server could not be started, reached or initialised (at :meth:`MCPToolset.connect`).

    The message names the server and the cause (also chained as ``__cause__``): a command that
    does not exist, a URL that refuses connections, a server that exits or does not finish the
    handshake within ``connect_timeout``. Failures *during* a run never raise this: they become
    error tool results the model reads.
    """


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(f"MCP tools need the 'mcp' package (the official MCP SDK, 2.x): {_INSTALL}"
                                 ) from exc


def _describe(server: Any) -> str:
    """A short, credential-free description of ``server`` for messages."""
    if isinstance(server, str):
        return re.sub(r"//[^/@]*@", "//", server)
    if isinstance(server, (list, tuple)):
        return shlex.join(str(a) for a in server)[:200]
    command = getattr(server, "command", None)
    if isinstance(command, str):
        return shlex.join([command, *getattr(server, "args", [])])[:200]
    name = getattr(server, "name", None)
    if isinstance(name, str):
        return f"in-process {name}"
    return type(server).__name__


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (anyio task groups wrap transport errors)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _is_connection_failure(exc: BaseException) -> bool:
    import anyio
    from mcp.shared.exceptions import MCPError
    from mcp.types import CONNECTION_CLOSED

    leaf = _leaf(exc)
    if isinstance(leaf, MCPError):
        return leaf.code == CONNECTION_CLOSED
    return isinstance(leaf, (OSError, EOFError, anyio.ClosedResourceError, anyio.BrokenResourceError,
                             anyio.EndOfStream)) or type(leaf).__module__.startswith(("httpx", "httpcore"))


def _known_closed(client: Client) -> bool:
    """Whether the SDK already knows the connection is closed, so a request would fail before it is
    written (an idle stdio server that died, an HTTP stream that ended). Reads the SDK dispatcher's
    private ``_closed`` flag; ``False`` when it cannot tell (then a failed call counts as possibly sent)."""
    try:
        dispatcher = getattr(client.session, "_dispatcher", None)
    except RuntimeError:
        return True
    return getattr(dispatcher, "_closed", False) is True


class _Connection:
    """One live MCP session, owned by its own task (anyio scopes must be entered and exited in one task)."""

    __slots__ = ("client", "duplicates", "lost", "stop", "stray", "strays", "task", "tools")

    def __init__(self) -> None:
        self.client: Client | None = None
        self.tools: dict[str, MCPToolSpec] = {}
        self.duplicates: set[str] = set()
        """Names the server lists for two different tools."""
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.lost: str | None = None
        """Why the connection is no longer usable, or ``None`` while it is."""
        self.strays = 0
        """Messages from the server that are not JSON-RPC and name no request (so no call can be told)."""
        self.stray = ""
        """The start of the latest of them."""

    def stray_seen(self, what: str) -> None:
        """Count one more stray message; ``what``: its start."""
        self.strays += 1
        self.stray = what


class MCPToolset:
    """The tools of one MCP server, bound to a live session; see the module docstring.

    Args:
        server: an ``http(s)://`` URL (Streamable HTTP); a command line as a list of strings, or an
            ``mcp.StdioServerParameters`` (stdio; the subprocess gets the SDK's default environment,
            ``HOME``/``PATH``/..., not this process's secrets, plus ``env`` if given there); an
            ``MCPServer`` or low-level ``Server`` (in process); or an ``mcp`` client ``Transport``.
        name: what messages call the server (default: the name the server gives in its handshake,
            else a description of ``server``).
        prefix: prepended to every tool name as ``prefix_name``, to keep them apart from local
            tools and other servers' (``[a-zA-Z0-9_-]``, at most 32 characters); default none.
        include: only these tools (server names); each must exist.
        exclude: leave these tools out (server names); unknown names are ignored.
        names: server name → fsm_agent name, for single tools (overrides ``prefix``).
        effects: server name → :class:`~fsm_agent.tools.ToolEffect` (or its value), overriding what
            the annotations say; each must exist.
        trust_annotations: take ``readOnlyHint`` / ``idempotentHint`` from the server (default);
            ``False``: every tool not in ``effects`` is ``side_effect``.
        timeout: seconds one call may take (default 600, as for local tools); ``None``: no limit. On
            expiry the MCP request is cancelled and the model gets a ``timeout`` error result.
        connect_timeout: seconds :meth:`connect` may take (start, handshake, listing).
        invalid_schema: a server tool whose ``inputSchema`` is not a valid JSON Schema (object at the
            root): ``"raise"`` (default) a :class:`~fsm_agent.errors.ToolDefinitionError` at connect;
            ``"exclude"``: leave it out, log a warning and record why in :attr:`excluded`.
        prefer_structured: ``False`` (default): the model gets the content blocks as the server sent
            them, and the ``structuredContent`` JSON only when there is no content (what most MCP
            hosts show a model). ``True``: the JSON in place of the text blocks (which the
            specification says should repeat it); images and resources are kept. An ``isError``
            result always gives its error text (the JSON only when it has no text).
        reconnect: after the connection is lost, open a new one on the next call (default).
        headers: HTTP headers for a URL server (e.g. ``Authorization``).
        client_options: more keyword arguments for ``mcp.Client`` (``mode="legacy"`` for the
            2025-11-25 handshake, ``client_info``, ``logging_callback`` ...).
        max_result_chars: the most text characters of one result the model reads (default
            100,000); past it the text is cut and a note says how much was left out. ``None``: no
            limit (a server's 30 MB answer then goes into the transcript whole).

    Raises:
        ConfigurationError: the ``mcp`` package is missing, or an option or ``server`` is invalid.
    """

    def __init__(
        self,
        server: Any,
        *,
        name: str | None = None,
        prefix: str | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        names: Mapping[str, str] | None = None,
        effects: Mapping[str, ToolEffect | str] | None = None,
        trust_annotations: bool = True,
        timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        connect_timeout: float = 30.0,
        invalid_schema: Literal["raise", "exclude"] = "raise",
        prefer_structured: bool = False,
        reconnect: bool = True,
        headers: Mapping[str, str] | None = None,
        client_options: Mapping[str, Any] | None = None,
        max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    ) -> None:
        _require_mcp()
        self._server = self._target(server)
        self._url = server if isinstance(server, str) else None
        if headers and self._url is None:
            raise ConfigurationError("MCPToolset: headers= applies to an http(s) URL server only")
        if prefix is not None and not PREFIX_RULE.match(prefix):
            raise ConfigurationError(f"MCPToolset: prefix {prefix!r} must match {PREFIX_RULE.pattern}")
        for label, value in (("include", include), ("exclude", exclude)):
            if isinstance(value, str):
                raise ConfigurationError(f"MCPToolset: {label}= takes a list of tool names, not the string {value!r}")
        if invalid_schema not in ("raise", "exclude"):
            raise ConfigurationError(f"MCPToolset: invalid_schema must be 'raise' or 'exclude', not {invalid_schema!r}")
        if max_result_chars is not None and (isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int)
                                             or max_result_chars < 1):
            raise ConfigurationError(f"MCPToolset: max_result_chars must be a positive integer or None, not "
                                     f"{max_result_chars!r}")
        for label, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if seconds is not None and not seconds > 0:
                raise ConfigurationError(f"MCPToolset: {label} must be a positive number of seconds, not {seconds!r}")
        try:
            self._effects = {k: ToolEffect(v) for k, v in (effects or {}).items()}
        except ValueError as exc:
            raise ConfigurationError(f"MCPToolset: effects= values must be one of "
                                     f"{[e.value for e in ToolEffect]}: {exc}") from exc
        for remote, local in (names or {}).items():
            if not NAME_RULE.match(local):
                raise ConfigurationError(f"MCPToolset: names[{remote!r}] = {local!r} must match {NAME_RULE.pattern}")
        self._given_name = name
        self.prefix = prefix
        """Prepended to each tool's name (``prefix_name``), or ``None``."""
        self.include = tuple(include) if include is not None else None
        self.exclude = tuple(exclude)
        self.names = dict(names or {})
        self.trust_annotations = trust_annotations
        self.timeout = timeout
        """Seconds one call may take, or ``None``."""
        self.connect_timeout = connect_timeout
        self.invalid_schema = invalid_schema
        self.prefer_structured = prefer_structured
        self.max_result_chars = max_result_chars
        """The most text characters of one result the model reads (the rest is cut, with a note
        saying so); ``None``: no limit."""
        self.reconnect = reconnect
        self.headers = dict(headers or {})
        self.client_options = dict(client_options or {})
        self.excluded: dict[str, str] = {}
        """Server tools left out at connect (server name → why): ``exclude=``, not in ``include=``, an
        invalid schema with ``invalid_schema="exclude"``."""
        self.connections = 0
        """How many connections were opened (1 after :meth:`connect`; more after reconnects)."""
        self._tools: tuple[MCPTool, ...] | None = None
        self._conn: _Connection | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._server_name: str | None = None

    # -- construction ----------------------------------------------------------------------
    @staticmethod
    def _target(server: Any) -> Any:
        from mcp import StdioServerParameters
        from mcp.server import Server
        from mcp.server.mcpserver import MCPServer

        if isinstance(server, str):
            if not server.startswith(("http://", "https://")):
                raise ConfigurationError(f"MCPToolset: the string server {server!r} is not an http(s) URL; for a "
                                         f"stdio server pass the command line as a list, e.g. {shlex.split(server)!r}")
            return server
        if isinstance(server, (list, tuple)):
            if not server or not all(isinstance(a, str) for a in server):
                raise ConfigurationError(f"MCPToolset: a command line must be a non-empty list of strings, "
                                         f"got {server!r}")
            return StdioServerParameters(command=server[0], args=list(server[1:]))
        if isinstance(server, (StdioServerParameters, MCPServer, Server)):
            return server
        if isinstance(server, contextlib.AbstractAsyncContextManager):  # an mcp Transport (a Protocol)
            return server
        raise ConfigurationError(f"MCPToolset: unsupported server {type(server).__name__}; pass an http(s) URL, a "
                                 "command line (list of strings), mcp.StdioServerParameters, an MCPServer or an "
                                 "mcp Transport")

    @property
    def name(self) -> str:
        """What messages call the server: ``name=``, else its handshake name, else a description."""
        return self._given_name or self._server_name or _describe(self._server)

    # -- lifecycle -------------------------------------------------------------------------
    async def connect(self) -> MCPToolset:
        """Start or reach the server, do the MCP handshake and list its tools (once; later calls
        return at once). Returns the toolset.

        Raises:
            MCPConnectionError: the server could not be started, reached, or initialised in time.
            ToolDefinitionError: a tool's ``inputSchema`` is invalid (``invalid_schema="raise"``).
            ConfigurationError: ``include``/``effects``/``names`` name a tool the server does not
                offer, or two tools end up with the same fsm_agent name; the toolset is closed again.
        """
        if self._closed:
            raise ConfigurationError(f"MCP toolset {self.name!r} was closed; make a new one to connect again")
        async with self._lock:
            if self._tools is not None:
                return self
            conn = await self._open()
            try:
                self._tools = self._build(conn.tools, conn.duplicates)
            except BaseException:
                await self._shut(conn)
                self._conn = None
                raise
        return self

    async def close(self) -> None:
        """End the connection (and stop a stdio subprocess); idempotent. Calls made afterwards
        answer with an ``mcp_closed`` error result."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._shut(conn)

    async def __aenter__(self) -> MCPToolset:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _open(self) -> _Connection:
        conn = _Connection()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if connect gave up
        conn.task = asyncio.create_task(self._own(conn, ready), name=f"mcp:{self.name}")
        try:
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.shield(ready)
        except TimeoutError as exc:
            await self._shut(conn)
            raise MCPConnectionError(f"MCP server {self.name!r} did not finish the handshake and tool listing within "
                                     f"{self.connect_timeout:g} s; check that it is an MCP server, or raise "
                                     "connect_timeout") from exc
        except BaseException as exc:
            await self._shut(conn)
            if isinstance(exc, asyncio.CancelledError):
                raise
            cause = _leaf(exc)
            raise MCPConnectionError(f"could not connect to MCP server {self.name!r}: {type(cause).__name__}: {cause}. "
                                     "Check the URL or command, and that the server starts on its own."
                                     ) from cause
        self._conn = conn
        self.connections += 1
        return conn

    async def _own(self, conn: _Connection, ready: asyncio.Future[None]) -> None:
        """The connection's task: enter the client, list the tools, wait for ``stop``, exit."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.server import Server
        from mcp.server.mcpserver import MCPServer

        try:
            async with contextlib.AsyncExitStack() as stack:
                target = self._server
                if self._url is not None and self.headers:
                    from mcp.shared._httpx_utils import create_mcp_http_client

                    http = await stack.enter_async_context(create_mcp_http_client(headers=self.headers))
                    target = streamable_http_client(self._url, http_client=http)
                elif self._url is not None:
                    target = streamable_http_client(self._url)
                elif isinstance(target, StdioServerParameters):
                    target = stdio_client(target)
                if not isinstance(target, (MCPServer, Server)):  # in process: no JSON-RPC text to misread
                    target = CheckedTransport(target, conn.stray_seen)
                client = await stack.enter_async_context(Client(target, **self.client_options))
                conn.tools, conn.duplicates = await self._list(client)
                info = client.server_info
                if info is not None and info.name and self._server_name is None:
                    self._server_name = info.name
                conn.client = client
                ready.set_result(None)
                await conn.stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to connect(), or marks the connection lost
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            elif conn.lost is None and not conn.stop.is_set():
                cause = _leaf(exc)
                conn.lost = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
                log.warning("MCP server %r: connection lost: %s", self.name, conn.lost)
        finally:
            if conn.lost is None and not conn.stop.is_set():
                conn.lost = "the connection ended"
            conn.client = None

    @staticmethod
    async def _list(client: Client) -> tuple[dict[str, MCPToolSpec], set[str]]:
        """The server's tools by name, and the names it gives two different tools (the same tool
        listed twice, as a paginating server may, is one)."""
        tools: dict[str, MCPToolSpec] = {}
        duplicates: set[str] = set()
        cursor: str | None = None
        for _ in range(_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for t in page.tools:
                if t.name in tools and tools[t.name] != t:
                    duplicates.add(t.name)
                tools.setdefault(t.name, t)
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools, duplicates

    async def _shut(self, conn: _Connection) -> None:
        """Stop the connection's task: let it close the session (up to ``_CLOSE_WAIT`` s), or cancel it
        at once when it never got ready (a handshake that hangs has nothing to close gracefully)."""
        conn.stop.set()
        task = conn.task
        if task is None or task.done():
            return
        done: set[asyncio.Task[None]] = set()
        if conn.client is not None:
            done, _ = await asyncio.wait({task}, timeout=_CLOSE_WAIT)
        if not done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def _build(self, specs: Mapping[str, MCPToolSpec], duplicates: set[str]) -> tuple[MCPTool, ...]:
        self.excluded = {}
        for label, wanted in (("include", self.include or ()), ("effects", self._effects), ("names", self.names)):
            missing = sorted(set(wanted) - set(specs))
            if missing:
                raise ConfigurationError(f"MCP server {self.name!r} has no tool {', '.join(map(repr, missing))} "
                                         f"(named in {label}=); it offers: {', '.join(sorted(specs)) or 'none'}")
        tools: list[MCPTool] = []
        by_name: dict[str, str] = {}
        for remote, spec in specs.items():
            if self.include is not None and remote not in self.include:
                self.excluded[remote] = "not in include="
                continue
            if remote in self.exclude:
                self.excluded[remote] = "in exclude=" + (" (the server lists two tools of this name)"
                                                         if remote in duplicates else "")
                continue
            if remote in duplicates:
                raise ConfigurationError(f"MCP server {self.name!r} lists two different tools named {remote!r}: which "
                                         f"one a call would reach cannot be told; pass exclude=[{remote!r}] to leave "
                                         "both out")
            local = self.names.get(remote) or local_name(self.prefix, remote)
            if local in by_name:
                raise ConfigurationError(f"MCP server {self.name!r}: tools {by_name[local]!r} and {remote!r} would "
                                         f"both be named {local!r}; rename one with names={{{remote!r}: '...'}}")
            effect = self._effects.get(remote) or effect_from_annotations(spec.annotations,
                                                                          trust=self.trust_annotations)
            try:
                tool = MCPTool(self, spec, name=local, effect=effect, call_timeout=self.timeout)
            except ToolDefinitionError as exc:
                if self.invalid_schema == "raise":
                    raise ToolDefinitionError(f"{exc}; pass exclude=[{remote!r}] or invalid_schema='exclude' to "
                                              "leave it out") from exc
                self.excluded[remote] = str(exc)
                log.warning("MCP server %r: tool %r left out: %s", self.name, remote, exc)
                continue
            by_name[local] = remote
            tools.append(tool)
        return tuple(tools)

    # -- access ----------------------------------------------------------------------------
    @property
    def tools(self) -> tuple[MCPTool, ...]:
        """The server's tools as fsm_agent tools (the snapshot taken at connect).

        Raises:
            ConfigurationError: :meth:`connect` has not run yet.
        """
        if self._tools is None:
            raise ConfigurationError(f"MCP toolset {self.name!r} is not connected: use 'async with' or await "
                                     "connect() before taking its tools")
        return self._tools

    def __iter__(self) -> Iterator[MCPTool]:
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, name: str) -> MCPTool:
        """The tool with fsm_agent name or server name ``name``; ``KeyError`` if none."""
        for t in self.tools:
            if name in (t.name, t.remote_name):
                return t
        raise KeyError(name)

    @property
    def connected(self) -> bool:
        """Whether a connection is open and not known to be lost."""
        c = self._conn
        return c is not None and c.client is not None and c.lost is None and not _known_closed(c.client)

    @property
    def client(self) -> Client:
        """The live ``mcp.Client`` (resources, prompts, raw calls); valid until the next reconnect.

        Raises:
            ConfigurationError: not connected.
        """
        c = self._conn
        if c is None or c.client is None:
            raise ConfigurationError(f"MCP toolset {self.name!r} is not connected")
        return c.client

    def __repr__(self) -> str:
        n = "?" if self._tools is None else len(self._tools)
        return f"MCPToolset(server={self.name!r}, prefix={self.prefix!r}, tools={n}, connected={self.connected})"

    # -- calls -----------------------------------------------------------------------------
    async def _connection_for(self, tool: MCPTool, lost: _Connection | None) -> _Connection:
        """The connection to call on; reconnects once after ``lost`` (or a connection found lost)."""
        if self._closed or self._tools is None:
            raise ToolError(f"MCP server {self.name!r} is not connected (its toolset was closed), so tool "
                            f"{tool.name!r} cannot run. Continue without it.", kind="mcp_closed")
        conn = self._conn
        if conn is not None and conn is not lost and conn.lost is None and conn.client is not None:
            if not _known_closed(conn.client):
                return conn
            conn.lost = "the connection was closed"  # seen before sending: nothing was sent
        if not self.reconnect:
            why = (conn.lost if conn is not None else None) or "it was lost"
            raise ToolError(f"The connection to MCP server {self.name!r} is lost ({why}) and reconnecting is off, "
                            f"so tool {tool.name!r} cannot run. Continue without it.", kind="mcp_unavailable")
        async with self._lock:
            conn = self._conn
            if (conn is not None and conn is not lost and conn.lost is None and conn.client is not None
                    and not _known_closed(conn.client)):
                return conn  # another call reconnected meanwhile
            if conn is not None:
                self._conn = None
                await self._shut(conn)
            try:
                conn = await self._open()
            except MCPConnectionError as exc:
                raise ToolError(f"The connection to MCP server {self.name!r} was lost and reconnecting failed "
                                f"({exc}); tool {tool.name!r} cannot run now. Continue without it, or try again "
                                "later.", kind="mcp_unavailable") from exc
            if self._closed:  # closed while this call reconnected
                self._conn = None
                await self._shut(conn)
                raise ToolError(f"MCP server {self.name!r} is not connected (its toolset was closed), so tool "
                                f"{tool.name!r} cannot run. Continue without it.", kind="mcp_closed")
            log.info("MCP server %r: reconnected (connection %d)", self.name, self.connections)
            return conn

    async def _call(self, tool: MCPTool, arguments: dict[str, Any], ctx: ToolContext) -> Any:
        lost: _Connection | None = None
        while True:
            conn = await self._connection_for(tool, lost)
            if tool.remote_name not in conn.tools:
                raise ToolError(f"MCP server {self.name!r} no longer offers tool {tool.name!r} (server name "
                                f"{tool.remote_name!r}) after reconnecting. Continue without it.",
                                kind="mcp_unknown_tool")
            try:
                result = await self._send(conn, tool, arguments, ctx)
            except _Lost as exc:
                if conn.lost is None:
                    conn.lost = exc.reason
                if lost is None and self.reconnect and tool.effect is not ToolEffect.SIDE_EFFECT:
                    lost = conn  # safe to send again: the tool is pure or idempotent
                    log.info("MCP server %r: %s lost its connection; sending it again", self.name, tool.name)
                    continue
                raise self._lost_error(tool, exc.reason) from exc.__cause__
            return result_value(result, tool.remote_name, prefer_structured=self.prefer_structured,
                                max_chars=self.max_result_chars)

    async def _send(self, conn: _Connection, tool: MCPTool, arguments: dict[str, Any],
                    ctx: ToolContext) -> CallToolResult:
        client = conn.client
        if client is None:
            raise _Lost(conn.lost or "the connection ended")

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            ctx.report_progress(progress, total, message)

        deadline = asyncio.timeout(tool.call_timeout)
        strays = conn.strays
        try:
            async with deadline:
                return await client.call_tool(tool.remote_name, arguments, progress_callback=on_progress,
                                              meta=cast("RequestParamsMeta", {IDEMPOTENCY_META_KEY: ctx.idempotency_key}))
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:
            if not deadline.expired():
                raise _Lost(f"TimeoutError: {exc}") from exc  # the transport's own write timeout
            may = (" It may have taken effect before it was cancelled: check before calling it again."
                   if tool.effect is ToolEffect.SIDE_EFFECT else "")
            junk = (f" Meanwhile the server sent {conn.strays - strays} message(s) that are not valid JSON-RPC and "
                    f"name no request (the last: {conn.stray}); one may have been its answer."
                    if conn.strays > strays else "")
            raise ToolError(f"Tool {tool.name!r} (MCP server {self.name!r}) did not answer within "
                            f"{tool.call_timeout:g} s, so the request was cancelled on the server.{may}{junk} Try a "
                            "smaller request, or continue without it.", kind="timeout") from exc
        except Exception as exc:  # noqa: BLE001 - mapped to a result the model reads
            if _is_connection_failure(exc):
                cause = _leaf(exc)
                raise _Lost(f"{type(cause).__name__}: {cause}") from exc
            raise self._failure(tool, exc) from exc

    def _failure(self, tool: MCPTool, exc: BaseException) -> ToolError:
        from mcp.shared.exceptions import MCPError

        cause = _leaf(exc)
        what = invalid_answer(cause)
        if what is not None:
            may = (" It may have taken effect: check before calling it again." if tool.effect is
                   ToolEffect.SIDE_EFFECT else "")
            return ToolError(f"Tool {tool.name!r} (MCP server {self.name!r}): the server answered with an invalid "
                             f"result: {what}.{may} Continue without it, or try again later.",
                             kind="mcp_invalid_result")
        if isinstance(cause, MCPError):
            return ToolError(f"MCP server {self.name!r} refused the call to tool {tool.name!r}: {cause.message} "
                             f"(JSON-RPC error {cause.code}).", kind="mcp_error")
        return ToolError(f"The call to tool {tool.name!r} (MCP server {self.name!r}) failed: "
                         f"{type(cause).__name__}: {cause}", kind="mcp_error")

    def _lost_error(self, tool: MCPTool, reason: str) -> ToolError:
        may = ("It may or may not have taken effect: check before calling it again." if tool.effect is
               ToolEffect.SIDE_EFFECT else "It had no effect that matters (the tool is "
               f"{tool.effect.value}), but it did not finish.")
        after = ("The connection will be reopened for the next call." if self.reconnect and not self._closed else
                 "This server's tools are unavailable for the rest of the run.")
        return ToolError(f"The connection to MCP server {self.name!r} was lost while tool {tool.name!r} was running "
                         f"({reason}; the server may have crashed or been stopped). {may} {after}",
                         kind="mcp_connection_lost")

class _Lost(Exception):
    """Internal: the call's connection failed (transport closed, process gone)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def mcp_tools(server: Any, **options: Any) -> MCPToolset:
    """An :class:`MCPToolset` for ``server`` (not yet connected): use it as ``async with
    mcp_tools(server, prefix="fs") as fs: ... Agent(provider, tools=[*fs])``, or ``await
    mcp_tools(server).connect()`` and later ``close()``. ``options`` are :class:`MCPToolset`'s.

    Raises:
        ConfigurationError: the ``mcp`` package is missing (``pip install "fsm-agent[mcp]"``), or
            ``server`` / an option is invalid.
    """
    return MCPToolset(server, **options)
