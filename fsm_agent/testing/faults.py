"""A store that fails on purpose: :class:`FaultyStore` wraps any :class:`~fsm_agent.store.Store`
and makes chosen calls fail, so a test can show what a driver, a watcher or a user's own code does
when the disk fills, the database is locked or the connection drops, without arranging the real
condition.

Shapes::

    store = FaultyStore(inner)                 # any Store; every call is passed through and counted
    fault = store.fail(operation, *, nth=1, times=1, for_seconds=None, when=None,
                       error=None, transient=False, after_commit=False)
    store.calls["write"]                       # calls of each operation so far (failed ones included)
    store.failures                             # [(operation, exception)] for every injected failure
    fault.fired                                # how often this fault has fired
    fault.disarm(); store.clear()              # stop one fault / all of them

A fault fires on a call of ``operation`` (``"write"``, ``"acquire_lease"``, ... or ``"*"`` for
every operation) when all of these hold:

* the call is the ``nth`` call of that operation or a later one (counting every call, from 1);
* ``when(*args, **kwargs)`` is true, if given (it receives the call's arguments: the
  :class:`~fsm_agent.store.WriteBatch` for ``write``; ``(session_id, owner, ttl)`` for
  ``acquire_lease`` ...);
* it is within ``for_seconds`` of :meth:`FaultyStore.fail`, if given;
* it has fired fewer than ``times`` times (``None``: no limit; the default when
  ``for_seconds`` is given, else 1).

When it fires, the call raises ``error`` (an exception, or a callable returning one) or, by
default, a :class:`~fsm_agent.errors.StoreError` for the inner store's location with the given
``transient``. With ``after_commit=True`` the inner store runs the call first and the error is
raised after it succeeded: a lost acknowledgement (the write is stored, the caller is told it
failed). Otherwise the inner store is not called, so nothing of the call is stored.

Example::

    from fsm_agent.store import LedgerStatus, MemoryStore
    from fsm_agent.testing import FaultyStore, carries_ledger

    store = FaultyStore(MemoryStore())
    store.fail("write", nth=3)                                     # the 3rd write: disk full
    store.fail("acquire_lease", for_seconds=2.0, transient=True)   # every lease renewal for 2 s
    store.fail("write", when=carries_ledger(LedgerStatus.STARTED), after_commit=True)  # lost ack
    result = await Agent(provider, tools=tools, store=store).run("go")
    assert store.calls["write"] >= 3 and store.failures
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import StoreError
from ..store.base import (
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    LedgerStatus,
    SessionLink,
    SessionRecord,
    Store,
    WriteBatch,
)

__all__ = ["OPERATIONS", "Fault", "FaultyStore", "carries_ledger"]

OPERATIONS = frozenset({
    "create_session", "get_session", "list_sessions", "update_metadata", "write", "read_events",
    "latest_checkpoint", "get_checkpoint", "ledger", "acquire_lease", "release_lease", "push_control",
    "take_controls", "peek_controls", "close", "claim_idempotency_key", "idempotency_records", "link_session",
    "parent", "children",
})
"""The :class:`~fsm_agent.store.Store` methods a fault can name."""


def carries_ledger(status: LedgerStatus | str | None = None, *, effect: str | None = None,
                   tool: str | None = None) -> Callable[[WriteBatch], bool]:
    """A ``when`` predicate for ``write``: the batch carries a ledger entry with this ``status``
    (and ``effect`` / ``tool``, when given). ``carries_ledger(LedgerStatus.STARTED, effect="side_effect")``
    picks the write made just before a side-effecting tool runs."""
    want = LedgerStatus(status) if status is not None else None

    def predicate(batch: WriteBatch, *args: Any, **kwargs: Any) -> bool:
        return any((want is None or e.status is want) and (effect is None or e.effect == effect)
                   and (tool is None or e.tool == tool) for e in batch.ledger)

    return predicate


class Fault:
    """One armed failure of a :class:`FaultyStore` (made by :meth:`FaultyStore.fail`)."""

    def __init__(self, operation: str, *, nth: int = 1, times: int | None = 1, for_seconds: float | None = None,
                 when: Callable[..., bool] | None = None,
                 error: BaseException | Callable[[], BaseException] | None = None, transient: bool = False,
                 after_commit: bool = False) -> None:
        if operation != "*" and operation not in OPERATIONS:
            raise ValueError(f"unknown store operation {operation!r}; one of {', '.join(sorted(OPERATIONS))} or '*'")
        if nth < 1:
            raise ValueError("nth counts calls from 1")
        self.operation = operation
        self.nth = nth
        self.times = times
        self.until = time.monotonic() + for_seconds if for_seconds is not None else None
        self.when = when
        self.error = error
        self.transient = transient
        self.after_commit = after_commit
        self.fired = 0
        self.armed = True

    def __repr__(self) -> str:
        return (f"Fault({self.operation!r}, nth={self.nth}, times={self.times}, transient={self.transient}, "
                f"after_commit={self.after_commit}, fired={self.fired}, armed={self.armed})")

    def disarm(self) -> None:
        """Stop firing (calls pass through again)."""
        self.armed = False

    def matches(self, operation: str, number: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if not self.armed or self.operation not in ("*", operation) or number < self.nth:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        if self.until is not None and time.monotonic() >= self.until:
            return False
        return self.when is None or bool(self.when(*args, **kwargs))

    def make_error(self, location: str, operation: str, number: int) -> BaseException:
        if self.error is None:
            return StoreError(location, operation, f"injected fault (call {number} of {operation})",
                               transient=self.transient)
        if isinstance(self.error, BaseException):
            return self.error
        return self.error()


class FaultyStore(Store):
    """Wraps ``inner`` and fails the calls chosen with :meth:`fail` (see the module docstring).

    Args:
        inner: the store that does the work.
        faults: faults to arm at once (as :meth:`fail` makes them).

    Attributes:
        inner: the wrapped store.
        location: ``inner.location`` when it has one, else ``repr(inner)``; named by default errors.
        calls: ``Counter`` of calls per operation, failed ones included.
        failures: ``[(operation, exception)]`` for every failure injected, in order.
        faults: the armed faults, in the order they are checked (the first that matches fires).
    """

    def __init__(self, inner: Store, faults: Sequence[Fault] = ()) -> None:
        self.inner = inner
        self.location: str = getattr(inner, "location", None) or repr(inner)
        self.calls: Counter[str] = Counter()
        self.failures: list[tuple[str, BaseException]] = []
        self.faults: list[Fault] = list(faults)

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r}, faults={self.faults!r})"

    def __getattr__(self, name: str) -> Any:  # the inner store's extras (path, schema_version ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def fail(self, operation: str, *, nth: int = 1, times: int | None = 1, for_seconds: float | None = None,
             when: Callable[..., bool] | None = None, error: BaseException | Callable[[], BaseException] | None = None,
             transient: bool = False, after_commit: bool = False) -> Fault:
        """Arm a fault and return it. ``times`` defaults to no limit when ``for_seconds`` is given.

        Raises:
            ValueError: ``operation`` is not a store method (nor ``"*"``), or ``nth < 1``.
        """
        if for_seconds is not None and times == 1:
            times = None
        fault = Fault(operation, nth=nth, times=times, for_seconds=for_seconds, when=when, error=error,
                      transient=transient, after_commit=after_commit)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Disarm and forget every fault (the counts stay)."""
        for fault in self.faults:
            fault.disarm()
        self.faults.clear()

    async def _call(self, operation: str, *args: Any, **kwargs: Any) -> Any:
        self.calls[operation] += 1
        number = self.calls[operation]
        fault = next((f for f in self.faults if f.matches(operation, number, args, kwargs)), None)
        if fault is None:
            return await getattr(self.inner, operation)(*args, **kwargs)
        fault.fired += 1
        error = fault.make_error(self.location, operation, number)
        if fault.after_commit:
            await getattr(self.inner, operation)(*args, **kwargs)
        self.failures.append((operation, error))
        raise error

    # -- the Store interface, passed through -------------------------------------------------
    async def create_session(self, record: SessionRecord) -> None:
        await self._call("create_session", record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self._call("get_session", session_id)  # type: ignore[no-any-return]

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        return await self._call("list_sessions", limit)  # type: ignore[no-any-return]

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        await self._call("update_metadata", session_id, metadata, goal_version)

    async def write(self, batch: WriteBatch) -> None:
        await self._call("write", batch)

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        return await self._call("read_events", session_id, after_seq, until_seq, types)  # type: ignore[no-any-return]

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        return await self._call("latest_checkpoint", session_id)  # type: ignore[no-any-return]

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return await self._call("get_checkpoint", checkpoint_id)  # type: ignore[no-any-return]

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        return await self._call("ledger", session_id)  # type: ignore[no-any-return]

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        return await self._call("acquire_lease", session_id, owner, ttl)  # type: ignore[no-any-return]

    async def release_lease(self, session_id: str, owner: str) -> None:
        await self._call("release_lease", session_id, owner)

    async def push_control(self, record: ControlRecord) -> None:
        await self._call("push_control", record)

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        return await self._call("take_controls", session_id, kinds)  # type: ignore[no-any-return]

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        return await self._call("peek_controls", session_id, kinds)  # type: ignore[no-any-return]

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        return await self._call("claim_idempotency_key", session_id, key, value)  # type: ignore[no-any-return]

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        return await self._call("idempotency_records", session_id, prefix)  # type: ignore[no-any-return]

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        return await self._call("link_session", link)  # type: ignore[no-any-return]

    async def parent(self, session_id: str) -> SessionLink | None:
        return await self._call("parent", session_id)  # type: ignore[no-any-return]

    async def children(self, session_id: str) -> list[SessionLink]:
        return await self._call("children", session_id)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._call("close")
