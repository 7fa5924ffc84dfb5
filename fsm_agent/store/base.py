"""Persistence: the session's append-only event log, checkpoints, the tool-call ledger, control
events and leases, behind one :class:`Store` interface (DESIGN.md §6, seed 004 §2, §4, §7).

Records and their compatibility rules (``SCHEMA_VERSION``; see ``docs/schema.md``):

* :class:`EventRecord` — one state change: ``event_id``, ``session_id``, ``turn_id``, ``seq``
  (monotonic per session, from 1), ``type``, ``ts``, ``payload``, ``schema_version``. The log
  is append-only; the transcript, the trajectory and the SSE stream are all read from it.
* :class:`Checkpoint` — a snapshot at a safe point that *references* a seq: the scalar state
  of the session (turn, usage, pending calls, budgets ...) but not the transcript, which is
  rebuilt from the ``message`` events up to that seq. Storage therefore grows linearly with
  the run, not with a full copy per step.
* :class:`LedgerEntry` — one tool call's life: ``proposed → approved → started → completed |
  failed`` (or ``interrupted`` / ``rejected``), each state written *before* the step it names.
* :class:`ControlRecord` — a control event (interrupt, cancel, steer, followup) queued by any
  thread or process, consumed by the driving worker at a safe point.
* :class:`SessionRecord` — the session's row: state, stop payload, lease, metadata.
* :class:`SessionLink` — a child session's link to the parent session that started it (an agent
  called as a tool, a handoff, a worker of a leader, a remote task), with the parent's tool-call
  id where there is one (``session_links`` table, migration 3).

Every write a driver makes at one point goes through :meth:`Store.write` as one transaction.

Failures (every backend, every method): an operation that fails for a reason outside fsm_agent
(a full disk, a read-only file, a database locked past its busy timeout, a dropped connection)
raises :class:`~fsm_agent.errors.StoreError` naming the store's location (a file path, or a DSN
without its password), the operation and the cause, chained (``raise ... from``) to the driver's
own exception. ``StoreError.transient`` says whether the same call may succeed later (locked,
busy, connection lost) or a person must act (disk full, read-only, permission, corrupt). A failed
:meth:`Store.write` leaves nothing of its batch visible, and the store stays usable. Conditions the
caller must react to keep their own types: :class:`~fsm_agent.errors.LeaseLost` (fencing, not a
``StoreError``), :class:`~fsm_agent.errors.SessionExistsError` and ``KeyError`` for an unknown
session. :class:`fsm_agent.testing.FaultyStore` injects these failures into any store for tests.
"""

from __future__ import annotations

import abc
import enum
import time
import uuid
from collections.abc import Sequence
from typing import Any

from attrs import field, frozen

from ..errors import LeaseLost

__all__ = [
    "QUEUED",
    "SCHEMA_VERSION",
    "Checkpoint",
    "ControlKind",
    "ControlRecord",
    "EventRecord",
    "LeaseLost",
    "LedgerEntry",
    "LedgerStatus",
    "LinkKind",
    "SessionLink",
    "SessionRecord",
    "Store",
    "WriteBatch",
    "check_link",
    "new_id",
]

SCHEMA_VERSION = 2
"""Version of events, checkpoints and ledger entries written by this release (2: checkpoints hold the
whole run state; see docs/schema.md)."""


def new_id() -> str:
    return uuid.uuid4().hex


def check_link(link: SessionLink) -> None:
    """Raise ``ValueError`` for a link no store may keep (see :meth:`Store.link_session`)."""
    for name in ("child_id", "parent_id", "kind"):
        value = getattr(link, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"a session link needs a non-empty {name}, got {value!r}")
    if link.child_id == link.parent_id:
        raise ValueError(f"session {link.child_id!r} cannot be its own parent")


class LedgerStatus(str, enum.Enum):
    """States of a tool call in the ledger."""

    PROPOSED = "proposed"
    APPROVED = "approved"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    REJECTED = "rejected"
    """A person or a policy decided it must not run (its result is the rejection)."""
    RESPONDED = "responded"
    """A person or a policy answered it instead of the tool (its result is that answer)."""
    INTERRUPTED = "interrupted"
    """It started, and the run stopped before it finished: its outcome is unknown, and the
    transcript says so. Closed: it is never run again silently."""
    NOT_RUN = "not_run"
    """The run stopped before it started; the transcript says it did not run. Closed."""

    @property
    def final(self) -> bool:
        """The call is closed: it has its result and never runs again."""
        return self in _CLOSED


_CLOSED = frozenset({LedgerStatus.COMPLETED, LedgerStatus.FAILED, LedgerStatus.REJECTED, LedgerStatus.RESPONDED,
                     LedgerStatus.INTERRUPTED, LedgerStatus.NOT_RUN})


QUEUED = "QUEUED"
"""The state of a session a server created before any worker started its first run
(:mod:`fsm_agent.server`); :meth:`fsm_agent.Agent.run` with that ``session_id`` adopts it."""


class ControlKind(str, enum.Enum):
    """LoopControl kinds (seed 004 §2)."""

    STEER = "steer"
    FOLLOWUP = "followup"
    INTERRUPT = "interrupt"
    CANCEL = "cancel"
    DECISION = "decision"
    """A wake-up for a run waiting in process (Hang-Wait): a decision was stored for it. Its text is
    the call ids; the decision itself is read from its record (:mod:`fsm_agent.store.decisions`)."""
    RESTRICT = "restrict"
    """Narrow the session's permissions; its text is ``{"restriction": {...}, "reason": ...}`` in the
    permissions file format (:mod:`fsm_agent.permissions`)."""
    REQUEST_PERMISSIONS = "request_permissions"
    """Ask to widen the session's permissions (a person approves it); its text is
    ``{"permissions": {...}, "reason": ...}``."""


@frozen
class EventRecord:
    """One record of a session's append-only log."""

    session_id: str
    seq: int
    """Position in the session's log, from 1, without gaps."""
    type: str
    payload: dict[str, Any]
    turn_id: str | None = None
    """``"<session_id>:<turn>"`` for events inside a turn, else ``None``."""
    ts: float = field(factory=time.time)
    """Unix time (seconds)."""
    event_id: str = field(factory=new_id)
    schema_version: int = SCHEMA_VERSION


@frozen
class Checkpoint:
    """A snapshot at a safe point; ``seq`` is the last event it includes."""

    checkpoint_id: str
    session_id: str
    seq: int
    safe_point: str
    """``PreTurn`` or ``MidTurn`` (where a resume continues), or a terminal state name."""
    data: dict[str, Any]
    """Scalar session state (turn, usage, cost, tool counts, pending calls, budgets, elapsed ...)."""
    ts: float = field(factory=time.time)
    schema_version: int = SCHEMA_VERSION


@frozen
class LedgerEntry:
    """One tool call's state in the ledger (keyed by ``session_id`` + ``call_id``)."""

    session_id: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str
    effect: str
    """``pure``, ``idempotent`` or ``side_effect`` (the tool's declaration)."""
    status: LedgerStatus
    turn: int
    result: dict[str, Any] | None = None
    """The unstructured ToolResultMessage once final, else ``None``."""
    updated_at: float = field(factory=time.time)
    schema_version: int = SCHEMA_VERSION


@frozen
class ControlRecord:
    """A control event for a session."""

    session_id: str
    kind: ControlKind
    text: str = ""
    control_id: str = field(factory=new_id)
    ts: float = field(factory=time.time)


@frozen
class SessionRecord:
    """A session's row."""

    session_id: str
    state: str
    """Machine state name (``PreTurn`` ... or a StopReason)."""
    goal: str = ""
    goal_version: int = 1
    stop: dict[str, Any] | None = None
    """The unstructured RunStop once a run ended, else ``None``."""
    metadata: dict[str, Any] = field(factory=dict)
    """Free data (the CLI keeps the agent's settings here so ``fsm-agent resume`` can rebuild it)."""
    last_seq: int = 0
    created_at: float = field(factory=time.time)
    updated_at: float = field(factory=time.time)
    lease_owner: str | None = None
    lease_until: float | None = None
    """Unix time the lease expires."""


class LinkKind(str, enum.Enum):
    """How a child session came to be (:class:`SessionLink` ``kind``). The store keeps any
    non-empty string; these are the names fsm_agent writes."""

    AGENT_TOOL = "agent_tool"
    """An agent called as a tool by its parent's model (``fsm_agent.orchestration.agent_tool``)."""
    HANDOFF = "handoff"
    """An agent that took over from its parent with a recovery package (``fsm_agent.orchestration.handoff``)."""
    WORKER = "worker"
    """A worker of a leader (``fsm_agent.orchestration.team``)."""
    REMOTE = "remote"
    """A task of a remote agent (A2A); its ``child_id`` names no session of this store."""


@frozen
class SessionLink:
    """A child session's link to its parent: written before the child starts, never changed.

    A child has one parent (``child_id`` is unique); a parent has any number of children.
    """

    child_id: str
    """The child session's id (or, for a ``remote`` link, the remote task's id)."""
    parent_id: str
    """The session that started the child."""
    kind: str
    """How: a :class:`LinkKind` value (``agent_tool``, ``handoff``, ``worker``, ``remote``) or another name."""
    call_id: str | None = None
    """The parent's tool-call id that started the child, or ``None`` (a handoff, a worker of an orchestrator)."""
    metadata: dict[str, Any] = field(factory=dict)
    """Free data (the sub-agent's tool name, a worker's index, a remote agent's URL ...)."""
    created_at: float = field(factory=time.time)
    """Unix time (seconds) the link was written."""


@frozen
class WriteBatch:
    """Everything one safe point writes, committed as one transaction.

    ``expected_owner``: when set, the batch commits only while that worker holds the
    session's lease (fencing: a worker whose lease was taken over cannot write).
    """

    session_id: str
    events: tuple[EventRecord, ...] = ()
    checkpoint: Checkpoint | None = None
    ledger: tuple[LedgerEntry, ...] = ()
    state: str | None = None
    stop: dict[str, Any] | None = None
    expected_owner: str | None = None


class Store(abc.ABC):
    """Where sessions live. All methods are coroutines; implementations must be safe for many
    sessions at once, and (SQLite, PostgreSQL) for several processes on one database.

    Any method may raise :class:`~fsm_agent.errors.StoreError` (see the module docstring): the
    operation failed for an outside reason; ``transient`` says whether retrying may help.
    """

    @abc.abstractmethod
    async def create_session(self, record: SessionRecord) -> None:
        """Insert a new session.

        Raises:
            SessionExistsError: a session with ``record.session_id`` exists (a ``KeyError``).
            StoreError: the store could not be written.
        """

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    @abc.abstractmethod
    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        """Most recently updated first."""

    @abc.abstractmethod
    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None: ...

    @abc.abstractmethod
    async def write(self, batch: WriteBatch) -> None:
        """Commit events, checkpoint, ledger entries and the session state in one transaction.

        All or nothing: when it raises, nothing of the batch is visible.

        Raises:
            LeaseLost: ``batch.expected_owner`` no longer holds the lease (not a ``StoreError``).
            KeyError: unknown session.
            SessionConflictError: the first event's seq does not follow the session's last one (another writer).
            StoreError: the store could not be written (disk full, read-only, locked, connection
                lost). When the cause is a lost acknowledgement (the connection dropped during
                COMMIT) the batch may in fact be stored: read the session back before retrying.
        """

    @abc.abstractmethod
    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        """Events with ``after_seq < seq <= until_seq`` (of ``types`` only, when given) in seq order."""

    @abc.abstractmethod
    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None: ...

    @abc.abstractmethod
    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None: ...

    @abc.abstractmethod
    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        """Ledger entries by call id."""

    @abc.abstractmethod
    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        """Take or renew the session's lease for ``ttl`` seconds; ``False`` when another worker holds
        an unexpired lease. Atomic: of two racing workers exactly one gets it.

        A :class:`~fsm_agent.errors.StoreError` means the lease's state is unknown to the caller:
        it may retry (when ``transient``), but must stop driving before its current lease ends if
        no renewal succeeds by then."""

    @abc.abstractmethod
    async def release_lease(self, session_id: str, owner: str) -> None: ...

    @abc.abstractmethod
    async def push_control(self, record: ControlRecord) -> None:
        """Queue a control event (from any thread or process)."""

    @abc.abstractmethod
    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        """Remove and return the queued controls of ``kinds``, oldest first (each is taken once)."""

    @abc.abstractmethod
    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        """Whether a control of ``kinds`` is queued (cheap; for mid-phase polling)."""

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        """Store ``value`` under ``(session_id, key)`` unless a value is stored there already.

        Atomic across processes and hosts: of two racing callers exactly one stores its value.
        Used by the server for idempotent decisions and controls (``decision:<call id>``,
        ``control:<Idempotency-Key>``).

        Returns:
            ``(stored value, True)`` when this call stored ``value``; ``(the earlier value, False)``
            when a value was there.

        Raises:
            KeyError: unknown session.
            NotImplementedError: this store keeps no idempotency keys.
            StoreError: the store could not be read or written.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no idempotency keys")

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """The values stored by :meth:`claim_idempotency_key` for ``session_id`` whose key starts
        with ``prefix``, by key.

        Raises:
            NotImplementedError: this store keeps no idempotency keys.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no idempotency keys")

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        """Record ``link`` (a child session's parent) unless ``link.child_id`` has a link already.

        Atomic across processes and hosts: of two racing callers exactly one stores its link. The
        child session need not exist yet (links are written before the child starts, and a
        ``remote`` child is no session of this store).

        Returns:
            ``(link, True)`` when this call stored it; ``(the earlier link, False)`` when the child
            had one (it is never changed: compare its ``parent_id`` with yours).

        Raises:
            KeyError: ``link.parent_id`` is no session of this store.
            ValueError: an empty ``child_id``, ``parent_id`` or ``kind``, or a child that is its own parent.
            NotImplementedError: this store keeps no links.
            StoreError: the store could not be read or written.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no session links")

    async def parent(self, session_id: str) -> SessionLink | None:
        """The link of ``session_id`` to its parent, or ``None`` for a session no parent started.

        Raises:
            NotImplementedError: this store keeps no links.
            StoreError: the store could not be read.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no session links")

    async def children(self, session_id: str) -> list[SessionLink]:
        """The links of the sessions ``session_id`` started, oldest first (none for an unknown session).

        Raises:
            NotImplementedError: this store keeps no links.
            StoreError: the store could not be read.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no session links")

    async def close(self) -> None:
        """Release connections (idempotent)."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
