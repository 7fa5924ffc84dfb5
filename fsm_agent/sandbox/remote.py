"""RemoteSandbox: CodeAct against an executor you run elsewhere, over a documented HTTP JSON shape.

:class:`RemoteSandbox` adapts any :class:`RemoteExecutor` to the
:class:`~fsm_agent.sandbox.base.Sandbox` protocol; :class:`HttpRemoteExecutor` is the shipped client.
A service of your own implements the wire shape below (version 1), and fsm_agent talks to it.

Wire shape, all bodies JSON (UTF-8), every request with the client's ``headers`` (e.g.
``Authorization``):

``GET {base_url}/guarantees`` → ``200`` with a guarantees object::

    {"sandbox": "my-firecracker", "network_isolated": true, "filesystem_readonly": true, ...,
     "reasons": {"disk_quota": "why not"}, "mechanisms": {"network_isolated": "how"}, "details": {}}

(every name of :data:`~fsm_agent.sandbox.base.GUARANTEE_NAMES`; a missing one counts as ``false``).

``POST {base_url}/run`` with::

    {"version": 1, "code": "print(1)", "files": {"data/in.csv": "<base64>"},
     "limits": {"memory_bytes": 536870912, "cpu_seconds": 10, "wall_seconds": 30.0, "processes": 32,
                "file_size_bytes": 16777216, "open_files": 64, "output_bytes": 65536}}

→ ``200`` with ``{"result": {...}}``, the result object holding the fields of
:class:`~fsm_agent.sandbox.base.ExecutionResult`: ``sandbox``, ``stdout``, ``stderr``,
``exit_code`` (int or null), ``signal`` (int or null), ``return_value`` (any JSON), ``return_repr``
(string or null), ``error`` (null or ``{"type", "message", "traceback", "line"}``), ``files``
(``[{"path", "change": "created|modified|deleted", "kind": "file|symlink|other", "size", "sha256"}]``),
``limits_hit`` (names of :data:`~fsm_agent.sandbox.base.LIMIT_NAMES`), ``duration_s``,
``stdout_bytes``, ``stderr_bytes``, ``files_truncated``, ``workdir``. Only ``stdout``, ``stderr``
and ``exit_code`` are required; the rest default as in the class.

The code's own failures (an exception, a limit) are a ``200`` with the result saying so. Anything
else is an error status with ``{"error": {"type": "...", "message": "..."}}``: type
``invalid_input`` (400; raised here as :class:`~fsm_agent.sandbox.base.SandboxInputError`),
``unavailable`` (503; :class:`~fsm_agent.sandbox.base.SandboxUnavailableError`), anything else
:class:`~fsm_agent.sandbox.base.RemoteSandboxError`.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import aiohttp
import attrs
import orjson
from attrs import field, frozen

from ..types.codec import structure, unstructure
from ._inputs import check_required, checked_run
from .base import (
    LIMIT_NAMES,
    ExecutionResult,
    Guarantees,
    Limits,
    RemoteSandboxError,
    SandboxInputError,
    SandboxUnavailableError,
    check_timeout,
    typed_errors,
)
from .options import SandboxOptions, resolve

__all__ = ["HttpRemoteExecutor", "RemoteExecutor", "RemoteRequest", "RemoteSandbox", "WIRE_VERSION", "result_to_json"]

WIRE_VERSION = 1
"""The ``version`` of the ``POST /run`` body this client sends."""


@frozen
class RemoteRequest:
    """One run for a remote executor."""

    code: str
    files: dict[str, bytes] = field(factory=dict)
    """Relative path -> content, written into the run's work dir first."""
    limits: Limits = field(factory=Limits)

    def to_json(self) -> dict[str, Any]:
        """The ``POST /run`` body (files base64-encoded)."""
        return {"version": WIRE_VERSION, "code": self.code,
                "files": {p: base64.b64encode(c).decode("ascii") for p, c in self.files.items()},
                "limits": attrs.asdict(self.limits)}


@runtime_checkable
class RemoteExecutor(Protocol):
    """Something that runs code elsewhere: implement it for your own transport, or run a service with
    the HTTP wire shape of this module and use :class:`HttpRemoteExecutor`."""

    async def describe(self) -> Guarantees:
        """The guarantees the remote side gives."""
        ...

    async def execute(self, request: RemoteRequest) -> ExecutionResult:
        """Run one request; the code's own failures come back in the result, not as exceptions.

        Raises:
            RemoteSandboxError: the executor failed.
        """
        ...

    async def aclose(self) -> None:
        """Release connections (idempotent)."""
        ...


class HttpRemoteExecutor:
    """The HTTP JSON client of the wire shape in this module's docstring (aiohttp).

    The service is not trusted to keep the limits: an answer body larger than ``max_body_bytes`` is
    an error (read no further), and the result's ``stdout``, ``stderr`` and ``return_repr`` are cut
    to the run's ``output_bytes`` (``output`` then added to ``limits_hit``), its ``files`` to 1,000.

    Args:
        base_url: the service's root, e.g. ``https://sandbox.internal/v1``.
        headers: sent with every request (authentication).
        timeout_margin: seconds added to a run's ``wall_seconds`` for the whole HTTP exchange.
        connect_timeout: seconds to connect.
        max_body_bytes: the largest answer body read, bytes (default 16 MiB).

    Raises:
        SandboxInputError: an option is invalid (a timeout that is not a finite positive number ...).
    """

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None, timeout_margin: float = 10.0,
                 connect_timeout: float = 10.0, max_body_bytes: int = 16 * 1024 * 1024) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise SandboxInputError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout_margin = check_timeout(timeout_margin, "timeout_margin")
        self.connect_timeout = check_timeout(connect_timeout, "connect_timeout")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise SandboxInputError(f"max_body_bytes must be a whole number of at least 1024, got {max_body_bytes!r}")
        self.max_body_bytes = max_body_bytes
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"HttpRemoteExecutor({self.base_url!r})"

    async def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(headers=self.headers)
            self._loop = loop
        return self._session

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, total: float) -> Any:
        session = await self._client()
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=total, connect=self.connect_timeout)
        data = orjson.dumps(body) if body is not None else None
        try:
            async with session.request(method, url, data=data, timeout=timeout,
                                       headers={"Content-Type": "application/json"} if data else None) as resp:
                status = resp.status
                raw = bytearray()
                while chunk := await resp.content.read(65536):
                    raw += chunk
                    if len(raw) > self.max_body_bytes:  # read no further
                        raise RemoteSandboxError(f"{method} {url}: the answer is larger than {self.max_body_bytes} "
                                                 "bytes (max_body_bytes)", status=status)
                text = raw.decode("utf-8", "replace")
        except asyncio.TimeoutError as exc:
            raise RemoteSandboxError(f"{method} {url}: no answer within {total:g} s") from exc
        except aiohttp.ClientError as exc:
            raise RemoteSandboxError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        try:
            doc = orjson.loads(text) if text else None
        except orjson.JSONDecodeError:
            doc = None
        if status >= 400:
            err = doc.get("error") if isinstance(doc, dict) else None
            kind = err.get("type") if isinstance(err, dict) else None
            message = str(err.get("message")) if isinstance(err, dict) else text[:500]
            if kind == "invalid_input":
                raise SandboxInputError(f"the remote sandbox refused the input: {message}")
            if kind == "unavailable":
                raise SandboxUnavailableError(f"the remote sandbox is unavailable: {message}")
            raise RemoteSandboxError(f"{method} {url}: HTTP {status}: {message}", status=status, body=text)
        if doc is None:
            raise RemoteSandboxError(f"{method} {url}: the answer is not JSON", status=status, body=text)
        return doc

    async def describe(self) -> Guarantees:
        doc = await self._call("GET", "/guarantees", None, self.connect_timeout + self.timeout_margin)
        try:
            return Guarantees.from_json(doc)
        except ValueError as exc:
            raise RemoteSandboxError(f"GET {self.base_url}/guarantees: {exc}", body=orjson.dumps(doc).decode()) from exc

    async def execute(self, request: RemoteRequest) -> ExecutionResult:
        doc = await self._call("POST", "/run", request.to_json(), request.limits.wall_seconds + self.timeout_margin)
        result = doc.get("result") if isinstance(doc, dict) else None
        if not isinstance(result, dict):
            raise RemoteSandboxError(f"POST {self.base_url}/run: the answer has no 'result' object",
                                     body=orjson.dumps(doc).decode())
        data = {"sandbox": "remote", **result}
        try:
            got: ExecutionResult = structure(data, ExecutionResult)
        except Exception as exc:  # noqa: BLE001 - cattrs raises several kinds; all mean "off the wire shape"
            raise RemoteSandboxError(f"POST {self.base_url}/run: the result does not match the wire shape: {exc}",
                                     body=orjson.dumps(result).decode()[:2048]) from exc
        return _recap(got, request.limits.output_bytes)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def _recap(result: ExecutionResult, cap: int) -> ExecutionResult:
    """``result`` with its texts cut to ``cap`` bytes (``output`` noted) and at most 1,000 files."""

    def cut(text: str) -> tuple[str, bool]:
        data = text.encode("utf-8", "surrogatepass")
        return (data[:cap].decode("utf-8", "ignore"), True) if len(data) > cap else (text, False)

    stdout, a = cut(result.stdout)
    stderr, b = cut(result.stderr)
    rep, c = cut(result.return_repr) if result.return_repr is not None else (None, False)
    value = result.return_value
    if value is not None:
        try:
            too_big = len(orjson.dumps(value)) > cap
        except (orjson.JSONEncodeError, TypeError):
            too_big = True
        if too_big:
            value, c = None, True
    changed = {"stdout": stdout, "stderr": stderr, "return_repr": rep, "return_value": value}
    if len(result.files) > 1000:
        changed.update(files=result.files[:1000], files_truncated=True)
    if a or b or c:
        hit = set(result.limits_hit) | {"output"}
        changed["limits_hit"] = tuple(n for n in LIMIT_NAMES if n in hit)
    return attrs.evolve(result, **changed)


def result_to_json(result: ExecutionResult) -> dict[str, Any]:
    """An :class:`ExecutionResult` as the wire shape's result object (for a service written in Python)."""
    out: dict[str, Any] = unstructure(result)
    return out


class RemoteSandbox:
    """A :class:`~fsm_agent.sandbox.base.Sandbox` over a :class:`RemoteExecutor`.

    The input is checked here exactly as the local sandboxes check it; the guarantees are the ones the
    executor reports (:meth:`start`), and ``required`` is enforced against them.

    Args:
        executor: e.g. ``HttpRemoteExecutor("https://sandbox.internal/v1")``.
        options: the options every sandbox takes
            (:class:`~fsm_agent.sandbox.options.SandboxOptions`); only ``limits`` and ``required``
            apply here, and options that set a field of the local sandboxes are refused.
        limits: or as a keyword: default limits sent with each run.
        required: or as a keyword: guarantee names the remote side must report as holding, else
            ``run`` raises :class:`~fsm_agent.sandbox.base.GuaranteeNotHeldError` (default: none).

    Raises:
        SandboxInputError: ``executor`` is no :class:`RemoteExecutor`, an option is invalid, or
            ``options`` and a keyword are both given.
    """

    def __init__(self, executor: RemoteExecutor, *, options: SandboxOptions | None = None,
                 limits: Limits | None = None, required: Sequence[str] | None = None) -> None:
        if not isinstance(executor, RemoteExecutor):
            raise SandboxInputError(f"executor must implement RemoteExecutor (describe, execute, aclose), not "
                                    f"{type(executor).__name__}")
        given = {k: v for k, v in (("limits", limits), ("required", required)) if v is not None}
        self.options = resolve("RemoteSandbox", options, given).for_remote()
        self.executor = executor
        self._guarantees: Guarantees | None = None

    @property
    def limits(self) -> Limits:
        """Default limits of each run (:attr:`SandboxOptions.limits`)."""
        return self.options.limits

    @property
    def required(self) -> tuple[str, ...]:
        """The guarantees the executor must report as holding (:attr:`SandboxOptions.required`; none
        when ``None``)."""
        return self.options.required or ()

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.executor!r})"

    @property
    def name(self) -> str:
        return "remote"

    async def start(self) -> Guarantees:
        if self._guarantees is None:
            with typed_errors("remote", "asking the executor for its guarantees", RemoteSandboxError):
                self._guarantees = await self.executor.describe()
        return self._guarantees

    def guarantees(self) -> Guarantees:
        if self._guarantees is None:
            return Guarantees.unknown("remote", "not yet reported by the remote executor (await start())")
        return self._guarantees

    async def run(self, code: str, *, files: Mapping[str, bytes | str] | None = None,
                  timeout: float | None = None, limits: Limits | None = None) -> ExecutionResult:
        source, seeded, lim = checked_run(code, files, limits, timeout, self.limits)
        check_required("remote", self.required, await self.start())
        with typed_errors("remote", "running the code", RemoteSandboxError):  # an executor of yours too
            return await self.executor.execute(RemoteRequest(source, dict(seeded), lim))

    async def aclose(self) -> None:
        await self.executor.aclose()
