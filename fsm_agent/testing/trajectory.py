"""Replay a recorded trajectory offline and report every request that differs.

A session's event log holds what each model call was sent (the ``context`` hash of its
``model_call`` and ``turn`` events), what the model answered (the assistant ``message`` and its
``model_call`` event), what each tool returned (the tool-result ``message`` events) and what each
resume was given (the ``resume`` events: decisions, raised limits). :func:`replay_trajectory`
drives an agent's configuration again against those recordings, on a fresh in-memory store:

* the model is a provider that answers the recorded responses in order (and records each request);
* tool execution is replaced by the recorded result of the same call id, inside every
  ``wrap_tool_call`` of the chain: no real tool runs;
* the run starts from the recorded initial messages (the ``message`` events before the first
  ``transition``) with the recorded :class:`~fsm_agent.RunConfig`;
* each recorded resume is replayed with the same decisions and limits.

The driver hashes each replayed request exactly as it hashed the recorded one, so a replay of
an unchanged agent shows no difference, and a changed middleware, tool schema, system prompt or
setting shows at the first model call it touches::

    report = await replay_trajectory(store, "sess-1", agent)
    assert report.ok, report.summary()

Not replayed: control events (interrupt, cancel, steer, followup: their timing is not part of
the log), model calls that did not finish (a failed, interrupted or timed-out call is answered
with a non-retryable error), and calls a middleware makes itself through ``ctx.call_provider``
with the run's provider (a model-graded verifier: give the grader its own provider). Wrappers
that rewrite a tool's result or a model's response see the recorded, already rewritten, value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from attrs import field, frozen

from ..agent import Agent
from ..control import Decision
from ..errors import ProviderError, ResumeError
from ..config import RunConfig
from ..middleware import Middleware, Ordering
from ..providers.scripted import ScriptedProvider
from ..store.base import EventRecord, Store
from ..store.memory import MemoryStore
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.messages import AssistantMessage, Message, ModelStopReason, ToolResultMessage, Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import RunResult, StopReason

__all__ = ["RecordedTrajectory", "RequestDifference", "TrajectoryReport", "read_trajectory", "replay_trajectory"]


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    """The tuple fields' converter: typed, so attrs' ``__init__`` takes any iterable."""
    return tuple(value)


@frozen
class RequestDifference:
    """One model call whose replayed request differs from the recorded one."""

    index: int
    """The model call's position in the session (0-based, over every run of the session)."""
    turn: int | None
    """The recorded turn number of the call (or, for a call the recording does not have, the replayed one)."""
    recorded_hash: str | None
    """The recorded context hash (``None``: the replay made a call the recording does not have)."""
    replayed_hash: str | None
    """The replayed context hash (``None``: the replay made fewer calls)."""
    message_index: int | None
    """The first message of the request that differs from the recorded transcript at that call,
    or ``None`` when the messages agree (then the tools or the settings differ)."""
    description: str
    """What differs, in a sentence."""


@frozen
class TrajectoryReport:
    """What :func:`replay_trajectory` found."""

    session_id: str
    recorded_calls: int
    """Model calls in the recording."""
    replayed_calls: int
    """Model calls the replay made."""
    differences: tuple[RequestDifference, ...] = field(converter=_tuple)
    """Every call whose request differs, in call order."""
    recorded_stops: tuple[StopReason, ...] = field(converter=_tuple)
    """The stop of each recorded run (the first run, then each resume)."""
    replayed_stops: tuple[StopReason, ...] = field(converter=_tuple)
    """The stop of each replayed run."""
    notes: tuple[str, ...] = field(default=(), converter=_tuple)
    """Where the replay could not follow the recording (a resume refused, a tool result missing)."""
    result: RunResult | None = None
    """The last replayed run's result."""

    @property
    def recorded_stop(self) -> StopReason | None:
        """The recording's final stop reason."""
        return self.recorded_stops[-1] if self.recorded_stops else None

    @property
    def replayed_stop(self) -> StopReason | None:
        """The replay's final stop reason."""
        return self.replayed_stops[-1] if self.replayed_stops else None

    @property
    def ok(self) -> bool:
        """No request differs, the replay made as many calls, and every run stopped the same way."""
        return (not self.differences and self.recorded_calls == self.replayed_calls
                and self.recorded_stops == self.replayed_stops and not self.notes)

    def summary(self) -> str:
        """A few lines for a person (or an assertion message)."""
        lines = [f"session {self.session_id}: {self.recorded_calls} recorded model call(s), "
                 f"{self.replayed_calls} replayed; stops recorded "
                 f"{[s.value for s in self.recorded_stops]}, replayed {[s.value for s in self.replayed_stops]}"]
        for d in self.differences:
            lines.append(f"call {d.index} (turn {d.turn}): {d.description}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


@frozen
class RecordedCall:
    """One finished model call of the recording."""

    turn: int | None
    response: MessageResponse
    context_hash: str | None
    context_seq: int | None
    context_messages: int | None


@frozen
class RecordedResume:
    """What one recorded resume was given."""

    decisions: dict[str, Decision]
    limits: dict[str, Any]
    confirm_cancel: bool = False


@frozen
class RecordedTrajectory:
    """A session's log read for replay (see :func:`read_trajectory`)."""

    session_id: str
    config: RunConfig | None
    initial_messages: tuple[Message, ...] = field(converter=_tuple)
    calls: tuple[RecordedCall, ...] = field(converter=_tuple)
    tool_results: dict[str, ToolResultMessage]
    stops: tuple[StopReason, ...] = field(converter=_tuple)
    resumes: tuple[RecordedResume, ...] = field(converter=_tuple)
    messages: tuple[tuple[int, Message], ...] = field(converter=_tuple)
    """Every ``message`` event as (seq, message)."""

    def transcript_at(self, seq: int) -> list[Message]:
        """The transcript as it stood at event ``seq``."""
        return [m for s, m in self.messages if s <= seq]


def _turn_of(ev: EventRecord) -> int | None:
    if not ev.turn_id:
        return None
    try:
        return int(ev.turn_id.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


async def read_trajectory(store: Store, session_id: str) -> RecordedTrajectory:
    """Read what a replay needs from a session's log.

    Raises:
        ResumeError: unknown session.
    """
    if await store.get_session(session_id) is None:
        raise ResumeError(f"unknown session {session_id!r}")
    events = await store.read_events(session_id)
    config: RunConfig | None = None
    initial: list[Message] = []
    started = False
    calls: list[RecordedCall] = []
    results: dict[str, ToolResultMessage] = {}
    stops: list[StopReason] = []
    resumes: list[RecordedResume] = []
    messages: list[tuple[int, Message]] = []
    last_assistant: AssistantMessage | None = None
    stopped = False
    for ev in events:
        p = ev.payload
        if ev.type == "session_started" and p.get("config") is not None:
            config = structure(p["config"], RunConfig)
        elif ev.type == "message":
            msg: Message = structure(p["message"], Message)
            messages.append((ev.seq, msg))
            if not started:
                initial.append(msg)
            if isinstance(msg, AssistantMessage):
                last_assistant = msg
            elif isinstance(msg, ToolResultMessage):
                results.setdefault(msg.tool_call_id, msg)
        elif ev.type == "transition":
            if started and stopped and p.get("trigger") in ("resume", "resume_tools") and len(resumes) < len(stops):
                resumes.append(RecordedResume({}, {}))  # a resume from before ``resume`` events were written
            started = True
            stopped = False
        elif ev.type == "model_call":
            if last_assistant is None:
                continue
            ctx = p.get("context") or {}
            usage = structure(p["usage"], Usage) if p.get("usage") else None
            response = MessageResponse(f"replay_{len(calls) + 1}", p.get("model") or "", last_assistant,
                                       ModelStopReason(p["stop_reason"]), p.get("raw_stop_reason"), usage,
                                       p.get("provider") or "")
            calls.append(RecordedCall(_turn_of(ev), response, ctx.get("hash"), ctx.get("seq"), ctx.get("messages")))
            last_assistant = None
        elif ev.type == "run_stopped":
            stops.append(StopReason(p["stop"]["reason"]))
            stopped = True
        elif ev.type == "resume":
            resumes.append(RecordedResume({k: structure(v, Decision) for k, v in (p.get("decisions") or {}).items()},
                                          dict(p.get("limits") or {}), bool(p.get("confirm_cancel"))))
    return RecordedTrajectory(session_id, config, initial, calls, results, stops, resumes, messages)


class _RecordedResults(Middleware):
    """Innermost ``wrap_tool_call``: answers each call with its recorded result; never runs the tool."""

    name = "trajectory_replay"
    ordering = Ordering(position="innermost")

    def __init__(self, results: Mapping[str, ToolResultMessage]) -> None:
        self.results = dict(results)
        self.missing: list[str] = []

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: Any, ctx: Any) -> ToolResultMessage:
        found = self.results.get(call.id)
        if found is not None:
            return found
        self.missing.append(call.id)
        return ToolResultMessage(call.id, f"trajectory replay: no recorded result for call {call.id}",
                                 is_error=True, name=call.name)


def _unfinished(request: MessageRequest) -> MessageResponse:
    raise ProviderError("trajectory replay: the recording has no more finished model calls",
                        provider="replay", retryable=False)


def _brief(m: Message | None) -> str:
    if m is None:
        return "nothing"
    text = getattr(m, "text", "") or ""
    if not text and isinstance(m, AssistantMessage):
        text = ", ".join(f"{c.name}({c.id})" for c in m.tool_calls)
    text = " ".join(text.split())
    return f"{m.role} {text[:60]!r}" + ("…" if len(text) > 60 else "")


def _describe(recorded: list[Message], replayed: tuple[Message, ...], recorded_count: int | None
              ) -> tuple[int | None, str]:
    for i in range(max(len(recorded), len(replayed))):
        a = recorded[i] if i < len(recorded) else None
        b = replayed[i] if i < len(replayed) else None
        if a is None or b is None or unstructure(a) != unstructure(b):
            if a is None:
                return i, f"message {i} was added: {_brief(b)}"
            if b is None:
                return i, f"message {i} ({_brief(a)}) is missing from the replayed request"
            return i, f"message {i} differs: recorded {_brief(a)}, replayed {_brief(b)}"
    if recorded_count is not None and recorded_count != len(replayed):
        return None, (f"the recorded request had {recorded_count} messages, the replayed one {len(replayed)} "
                      "(the recorded context was not the whole transcript)")
    return None, "the messages agree with the recorded transcript; the tools or the request settings differ"


async def replay_trajectory(store: Store, session_id: str, agent: Agent, *,
                            config: RunConfig | None = None) -> TrajectoryReport:
    """Drive ``agent``'s configuration again against the recorded session ``session_id`` of ``store``
    (offline: recorded model responses and tool results) and report each request that differs.

    ``agent`` supplies the middleware, tools (names, schemas, effects; never run), system prompt
    and provider model name (part of each request); its provider is never called. ``config``
    overrides the recorded :class:`~fsm_agent.RunConfig`.

    Raises:
        ResumeError: unknown session.
    """
    rec = await read_trajectory(store, session_id)
    provider = ScriptedProvider([c.response for c in rec.calls] + [_unfinished],
                                capabilities=agent.provider.capabilities, model=agent.provider.model or "")
    provider.name = getattr(agent.provider, "name", "replay")
    results = _RecordedResults(rec.tool_results)
    replay_store = MemoryStore()
    replay = Agent(provider, tools=agent.tools, system_prompt=agent.system_prompt,
                   middleware=[*agent.middleware, results], config=config or rec.config or agent.config,
                   store=replay_store, worker_id="trajectory-replay", control_poll=agent.control_poll)
    notes: list[str] = []
    stops: list[StopReason] = []
    result = await replay.run(list(rec.initial_messages), session_id=session_id, config=config or rec.config)
    stops.append(result.stop.reason)
    for i, resume in enumerate(rec.resumes):
        if not result.stop.resumable:
            notes.append(f"recorded resume {i + 1} not replayed: the replay ended {result.stop.reason.value}")
            break
        limits = dict(resume.limits)
        try:
            result = await replay.resume(session_id, decisions=resume.decisions or None,
                                         confirm_cancel=resume.confirm_cancel, **limits)
        except ResumeError as exc:
            notes.append(f"recorded resume {i + 1} not replayed: {exc}")
            break
        stops.append(result.stop.reason)
    if results.missing:
        notes.append("no recorded result for tool call(s) " + ", ".join(results.missing))

    replayed_refs = [(_turn_of(ev), (ev.payload.get("context") or {}).get("hash"))
                     for ev in await replay_store.read_events(session_id, types=("model_call",))]
    differences: list[RequestDifference] = []
    for i in range(max(len(rec.calls), len(provider.requests))):
        call = rec.calls[i] if i < len(rec.calls) else None
        request = provider.requests[i] if i < len(provider.requests) else None
        turn, got = replayed_refs[i] if i < len(replayed_refs) else (None, None)
        if call is None:
            assert request is not None
            differences.append(RequestDifference(i, turn, None, got, None,
                                                 f"the replay made a model call the recording does not have "
                                                 f"({len(request.messages)} messages)"))
            continue
        if request is None:
            differences.append(RequestDifference(i, call.turn, call.context_hash, None, None,
                                                 "the replay stopped before this recorded model call"))
            continue
        if call.context_hash is not None and got == call.context_hash:
            continue
        recorded = rec.transcript_at(call.context_seq) if call.context_seq is not None else []
        index, text = _describe(recorded, request.messages, call.context_messages)
        if call.context_hash is None:
            text = "the recording has no context hash for this call; " + text
        differences.append(RequestDifference(i, call.turn, call.context_hash, got, index, text))
    return TrajectoryReport(session_id, len(rec.calls), len(provider.requests), differences,
                            rec.stops, stops, notes, result)
