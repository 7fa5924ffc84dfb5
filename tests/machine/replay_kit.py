"""Helpers of the replay tests (tests/machine/test_replay.py): record a scenario's live run, replay it
with a fresh agent and store, and compare everything a replay must reproduce.

A scenario is two functions:

* ``build(live)`` makes the agent. ``live=True``: the agent the run really happens with (its provider
  answers, its tools run, its store is written); ``live=False``: the same configuration (same tools,
  middleware, prompt, config, provider name and model) with a provider that must never be called and
  a fresh empty store.
* ``drive(agent, port, live)`` runs the scenario's segments (``agent.run``, ``agent.resume`` ...), each
  with ``port=port``, and returns what each segment ended with (an :class:`Outcome`). ``live`` says
  whether to act as the outside world (send a control through the store, kill a task ...): in a
  replay the outside world is the recording.

:func:`roundtrip` records, replays and checks: no divergence, the same outcomes (each
:class:`~fsm_agent.types.RunResult` equal as a whole), the replayed requests equal the live ones,
and the event log the recording holds equals, byte for byte, the one the live store holds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from attrs import define, field

from fsm_agent import Agent
from fsm_agent.errors import ReplayDivergence
from fsm_agent.providers import ScriptedProvider
from fsm_agent.store import Store
from fsm_agent.testing import EffectRecording
from fsm_agent.testing.effects import _canon
from fsm_agent.types import RunResult
from fsm_agent.types.codec import unstructure

__all__ = ["Outcome", "Roundtrip", "committed_writes", "log_bytes", "never_called", "outcome_of", "roundtrip",
           "stored_events"]


@define
class Outcome:
    """What one run segment ended with: its result, or the exception it raised."""

    result: RunResult | None = None
    error: str | None = None
    """``type(exc).__name__: message`` of what the segment raised (a ``CancelledError`` included)."""


async def outcome_of(work: Awaitable[RunResult]) -> Outcome:
    """Await one run segment; a raised exception (a cancelled task too) becomes its outcome.
    A :class:`ReplayDivergence` is raised, never an outcome."""
    try:
        return Outcome(await work)
    except ReplayDivergence:
        raise
    except BaseException as exc:  # noqa: BLE001 - the outcome of the segment is what is compared
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Outcome(error=f"{type(exc).__name__}: {exc}")


def never_called(model: str = "scripted") -> ScriptedProvider:
    """A provider for the replaying agent: any call to it fails the test."""

    def boom(request: Any) -> Any:
        raise AssertionError("a replay called the provider")

    provider = ScriptedProvider([boom], repeat_last=True, model=model)
    return provider


def log_bytes(events: Sequence[Any]) -> list[bytes]:
    """Each event (an :class:`~fsm_agent.store.EventRecord` or its canonical form) as canonical JSON bytes."""
    return [orjson.dumps(_canon(e if isinstance(e, dict) else unstructure(e)), option=orjson.OPT_SORT_KEYS)
            for e in events]


async def stored_events(store: Store, session_id: str) -> list[bytes]:
    """The session's whole event log as the store holds it, as canonical JSON bytes."""
    return log_bytes(await store.read_events(session_id))


def _spy(factory: Callable[[Any], Any], seen: list[Any]) -> Callable[[Any], Any]:
    """``factory`` with every model request its ports are asked for appended to ``seen``."""

    def make(live: Any) -> Any:
        port = factory(live)
        call_model = port.call_model

        async def spied(provider: Any, request: Any, **kw: Any) -> Any:
            seen.append(request)
            return await call_model(provider, request, **kw)

        port.call_model = spied
        return port

    return make


@define
class Roundtrip:
    """One scenario recorded and replayed (see :func:`roundtrip`)."""

    recording: EffectRecording
    live: list[Outcome]
    replayed: list[Outcome]
    live_requests: list[Any]
    replayed_requests: list[Any]
    live_logs: dict[str, list[bytes]] = field(factory=dict)
    """Each session's event log as the live store holds it (canonical JSON bytes)."""

    @property
    def results(self) -> list[RunResult]:
        return [o.result for o in self.live if o.result is not None]


async def roundtrip(build: Callable[[bool], Agent],
                    drive: Callable[[Agent, Callable[[Any], Any], bool], Awaitable[list[Outcome]]],
                    session_id: str, *, recording: EffectRecording | None = None,
                    written: Callable[[EffectRecording], list[Any]] | None = None,
                    since_seq: Callable[[], int] | None = None) -> Roundtrip:
    """Record ``drive`` with ``build(True)``, replay it with ``build(False)``, check and return both.

    Checked: the replay raised no :class:`ReplayDivergence` and used the whole recording; each
    replayed outcome equals the live one; the requests the replay asked for equal (as objects) those
    the live run sent; the events the recording's ``write`` effects carry for ``session_id``
    (``written``: another selection, e.g. only the writes that committed) equal byte for byte the log
    the live store holds (``since_seq``: after that seq, read once the live run is over: the part of
    the log the recorded segments wrote, when an earlier, unrecorded process wrote the rest).
    """
    rec = recording if recording is not None else EffectRecording()
    live_agent = build(True)
    live_requests: list[Any] = []
    live = await drive(live_agent, _spy(rec.record, live_requests), True)
    after = since_seq() if since_seq is not None else 0
    live_log = log_bytes(await live_agent.store.read_events(session_id, after))

    replay_agent = build(False)
    replayed_requests: list[Any] = []
    replayed = await drive(replay_agent, _spy(rec.replay, replayed_requests), False)
    rec.check()

    assert replayed == live, f"replayed outcomes differ:\nlive:     {live}\nreplayed: {replayed}"
    assert replayed_requests == live_requests
    assert rec.requests == [_canon(r) for r in live_requests]
    events = written(rec) if written is not None else rec.events
    recorded_log = log_bytes([e for e in events if e["session_id"] == session_id])
    assert recorded_log == live_log, _first_log_difference(recorded_log, live_log)
    assert await replay_agent.store.read_events(session_id) == [], "a replay wrote to the replaying agent's store"
    return Roundtrip(rec, live, replayed, live_requests, replayed_requests, {session_id: live_log})


def _first_log_difference(a: list[bytes], b: list[bytes]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i} differs:\nrecorded: {x[:600]!r}\nlive:     {y[:600]!r}"
    return f"the recorded log has {len(a)} events, the live store {len(b)}"


def committed_writes(rec: EffectRecording) -> list[Any]:
    """The events of the ``store.write`` effects whose write returned (a write that raised before it
    committed stored nothing)."""
    import pickle

    out: list[Any] = []
    for seg in rec.segments:
        ok = {i for what, i, payload in seg.arrivals if what == "done" and payload is not None
              and pickle.loads(payload)[0] == "ok"}  # noqa: S301 - our own recording
        for i, e in enumerate(seg.effects):
            if e.kind == "store.write" and i in ok:
                out.extend(e.args["a"][0]["events"])
    return out
