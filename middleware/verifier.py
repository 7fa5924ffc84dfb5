"""Verifier: decide in PostTurn whether the task is done, and record the evidence.

The verifier judges only turns in which the model ended without tool calls (and
did not pause); for the others ``post_turn`` returns ``None`` and the run goes on
as usual. It asks a **check** for a :class:`Verdict`:

* a callable ``(ctx) -> Verdict`` (plain or ``async``) — tests, linters, a
  comparison with known results; or
* :class:`ModelGrader` — asks a model (a separate grader provider, or the run's
  own) whether the last answer satisfies the task, with a JSON-schema
  ``response_format`` (``{"ok": bool, "reason": str}``) and a tolerant parse.

Then:

* ok → ``Complete(evidence=verdict.evidence)``: the run ends COMPLETED and the
  driver puts the evidence in the stop's ``evidence_refs``;
* not ok → ``Continue(message=UserMessage(feedback))``: the feedback is appended
  to the transcript and the model tries again;
* not ok after ``max_rejections`` feedback rounds → the run stops. Default
  ``on_exhausted="human"``: WAITING_HUMAN (resumable; seed 004's
  ``verdict.needs_human``), ``required_decision`` asking a person to accept the
  last answer or resume with guidance. ``"fail"``: FAILED_TERMINAL with
  ``error={"kind": "verification_failed", "reasons": [...]}``. Both carry every
  rejection's evidence in ``evidence_refs``.

**A task's acceptance checks** (task mode, :class:`fsm_agent.Task`): :meth:`Verifier.for_task`
gives the verifier that ``Agent.run_task`` puts in the task's chain; its check is
:class:`TaskChecks` (value checks, Python checks, then, when those pass, the graded criteria
through :class:`ModelGrader`), each check's result in the evidence as ``check[<name>] ...``.

A check that raises ends the run FAILED_TERMINAL (fail closed, the middleware
default). The rejection count lives in ``ctx.state(self)`` (``rejections``,
``verdicts``), so it starts again at 0 when a run is resumed.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from attrs import field, frozen

from fsm_agent import (
    CheckResult,
    Complete,
    Continue,
    MessageRequest,
    MessageResponse,
    Middleware,
    ModelStopReason,
    Ordering,
    OutputSchema,
    Provider,
    RunContext,
    StopReason,
    StopRun,
    SystemMessage,
    Task,
    TaskAnswer,
    UserMessage,
    parse_output,
)
from fsm_agent.errors import ProviderError

__all__ = ["GRADER_INSTRUCTIONS", "VERDICT_FORMAT", "VERDICT_SCHEMA", "ModelGrader", "TaskChecks", "Verdict",
           "Verifier", "grade", "grader_failure", "parse_verdict", "read_verdict"]


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@frozen
class Verdict:
    """A check's judgement of the last answer."""

    ok: bool
    """True: the task is done."""
    feedback: str = ""
    """Why; sent to the model as the next user message when ``ok`` is false."""
    evidence: tuple[str, ...] = field(default=(), converter=_strings)
    """References to what the judgement rests on (test ids, grader response ids); recorded in the stop."""


Check = Callable[[RunContext], Verdict | Awaitable[Verdict]]
"""``(ctx) -> Verdict``, plain or async."""

VERDICT_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string"}},
            "required": ["ok", "reason"],
            "additionalProperties": False,
        },
    },
}
"""The grader's ``response_format`` (OpenAI-style JSON schema; enforced by grammar on llama.cpp)."""

VERDICT_SCHEMA = OutputSchema("verdict", {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 300}},
    "required": ["ok", "reason"],
    "additionalProperties": False,
}, "whether the answer does what was asked, and why")
"""The grader's answer as an ``output_schema`` (``{"ok": bool, "reason": str}``, the reason at most
300 characters): schema-constrained decoding where the server has it (llama.cpp's grammar)."""

GRADER_INSTRUCTIONS = (
    "You are a strict grader. Decide whether the ANSWER fully and correctly satisfies the TASK. "
    'Reply with JSON only: {"ok": true or false, "reason": "one short sentence"}.'
)
"""Default system prompt of :class:`ModelGrader`."""

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


def parse_verdict(text: str) -> tuple[bool, str] | None:
    """``(ok, reason)`` from a grader's reply, or ``None`` when it holds no readable verdict.

    Accepts a bare JSON object, one inside a code fence or surrounded by prose, and ``"ok"``
    given as the strings ``"true"`` / ``"false"``; ``reason`` is cut to 2,000 characters.
    """
    s = _FENCE.sub("", text.strip())
    candidates = [s]
    start, end = s.find("{"), s.rfind("}")
    if 0 <= start < end:
        candidates.append(s[start:end + 1])
    for c in candidates:
        try:
            obj = orjson.loads(c)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        ok = obj.get("ok")
        if isinstance(ok, str) and ok.strip().lower() in ("true", "false"):
            ok = ok.strip().lower() == "true"
        if not isinstance(ok, bool):
            continue
        reason = obj.get("reason", "")
        return ok, (reason if isinstance(reason, str) else orjson.dumps(reason).decode())[:2000]
    return None


def read_verdict(response: MessageResponse, schema: OutputSchema | None = None) -> tuple[bool, str] | None:
    """``(ok, reason)`` from a grader's response, or ``None`` when it holds no readable verdict.

    With ``schema`` (the request's ``output_schema``, e.g. :data:`VERDICT_SCHEMA`), a reply that
    matches it is read as is; any other reply (and every reply without a schema) is read by
    :func:`parse_verdict`.
    """
    if schema is not None:
        parsed = parse_output(response, schema)
        if parsed.ok and isinstance(parsed.value, dict) and isinstance(parsed.value.get("ok"), bool):
            reason = parsed.value.get("reason", "")
            return parsed.value["ok"], (reason if isinstance(reason, str) else str(reason))[:2000]
    return parse_verdict(response.text)


def grader_failure(exc: ProviderError, who: str, required_decision: str) -> StopRun:
    """The typed stop for a grader call that failed (after the provider's own retries): WAITING_HUMAN
    with ``required_decision`` when ``exc`` is retryable (a resume can grade again; PostTurn has no
    FAILED_RETRYABLE row), FAILED_TERMINAL otherwise; ``error`` is the provider error's info."""
    stop = StopReason.WAITING_HUMAN if exc.retryable else StopReason.FAILED_TERMINAL
    return StopRun(stop, f"{who}: the grader call failed: {exc}", error=exc.to_info(),
                   required_decision=required_decision if exc.retryable else None)


async def grade(request: MessageRequest, call: Callable[[MessageRequest], Awaitable[MessageResponse]], *,
                provider: Provider, attempts: int, who: str, subject: str = "",
                records: list[dict[str, Any]] | None = None) -> Verdict:
    """Ask a model grader for a verdict: ``await call(request)`` up to ``attempts`` times, until a
    reply holds one (:func:`read_verdict`, against the request's ``output_schema`` if it has one).
    The grader of both the ``verifier`` plugin (:class:`ModelGrader`) and the ``planact`` plugin.

    Args:
        request: the grading request (its ``output_schema`` or ``response_format`` asks for the verdict).
        call: makes one call; a failed call raises (e.g. the :func:`grader_failure` stop).
        provider: the grader model (named in the evidence when the response does not name itself).
        attempts: calls allowed for one verdict.
        who: the plugin's name, first in the stop's detail.
        subject: what was graded, said in the stop's detail (``"on node s2"``); empty: nothing.
        records: when given, each call is appended as ``{"raw", "verdict", "response_id", "usage"}``.

    Returns:
        the verdict, with the evidence ``grader:<provider>/<model>:<response id>`` and
        ``grader verdict ok=<true|false>: <reason>``.

    Raises:
        StopRun: FAILED_TERMINAL, ``error.kind`` ``verifier_unreadable``, when no reply held a verdict.
    """
    raw = ""
    for _ in range(attempts):
        response = await call(request)
        raw = response.text
        parsed = read_verdict(response, request.output_schema)
        if records is not None:
            records.append({"raw": raw, "verdict": parsed, "response_id": response.id, "usage": response.usage})
        if parsed is not None:
            ok, reason = parsed
            name = f"{response.provider or provider.name}/{response.model or request.model}"
            evidence = (f"grader:{name}:{response.id}", f"grader verdict ok={str(ok).lower()}: {reason}")
            return Verdict(ok, reason, evidence)
    about = f" {subject}" if subject else ""
    raise StopRun(StopReason.FAILED_TERMINAL,
                  f"{who}: the grader gave no readable verdict{about} in {attempts} attempt(s); "
                  f"last reply: {raw[:300]!r}", error={"kind": "verifier_unreadable", "message": raw[:2000]})


class ModelGrader:
    """A check that asks a model whether the last answer satisfies the task.

    The grader sees what the model saw: the task is the first user message of
    ``ctx.messages`` (already masked when a Redaction middleware ran), the answer
    is ``ctx.last_response``'s text. The call goes through ``ctx.call_provider``
    (streamed to observers) with ``account=True``: its tokens and cost (USD) count toward the
    run's usage and budgets.

    Args:
        provider: the grader model, or ``None`` for the run's own provider.
        instructions: the grader's system prompt.
        task: the task text to grade against, or ``None`` for the first user message.
        max_tokens: output tokens of the grader's answer.
        temperature: sampling temperature of the grader (default 0).
        attempts: grader calls allowed for one verdict when the reply cannot be read.
        name: key of this grader's records in ``ctx.state`` (``calls``: raw reply, verdict, usage).

    A grader reply that stays unreadable ends the run FAILED_TERMINAL; a failed grader call ends it
    FAILED_TERMINAL, or WAITING_HUMAN when the error is retryable (PostTurn has no FAILED_RETRYABLE row).
    """

    def __init__(self, provider: Provider | None = None, *, instructions: str = GRADER_INSTRUCTIONS,
                 task: str | None = None, max_tokens: int = 200, temperature: float | None = 0.0,
                 attempts: int = 2, name: str = "ModelGrader") -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.provider = provider
        self.instructions = instructions
        self.task = task
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.attempts = attempts
        self.middleware_name = name

    def __repr__(self) -> str:
        who = "run's own" if self.provider is None else f"{self.provider.name}:{self.provider.model}"
        return (f"ModelGrader(provider={who!r}, max_tokens={self.max_tokens}, temperature={self.temperature}, "
                f"attempts={self.attempts})")

    def request(self, ctx: RunContext) -> MessageRequest:
        """The grading request for the current answer."""
        task = self.task
        if task is None:
            task = next((m.text for m in ctx.messages if isinstance(m, UserMessage)), "")
        answer = ctx.last_response.text if ctx.last_response is not None else ""
        provider = self.provider or ctx.provider
        return MessageRequest(
            model=provider.model or "",
            messages=(SystemMessage(self.instructions), UserMessage(f"TASK:\n{task}\n\nANSWER:\n{answer}")),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            response_format=VERDICT_FORMAT,
        )

    async def __call__(self, ctx: RunContext) -> Verdict:
        async def call(request: MessageRequest) -> MessageResponse:
            try:
                return await ctx.call_provider(request, provider=self.provider, account=True)
            except ProviderError as exc:
                raise grader_failure(exc, "verifier", "the answer could not be verified: accept it, or resume to "
                                                      "verify again") from exc

        return await grade(self.request(ctx), call, provider=self.provider or ctx.provider, attempts=self.attempts,
                           who="verifier", records=ctx.state(self).setdefault("calls", []))


class TaskChecks:
    """A task's acceptance checks as one verifier check (task mode).

    The ``value`` checks (on the answer's text and the validated output) and the Python checks run
    first; the graded criteria (each a :class:`ModelGrader` call whose tokens count toward the run's
    budgets) run only when those pass. The verdict passes when every check ran and passed; its
    feedback names each failed check and why; its evidence holds each result
    (:meth:`fsm_agent.CheckResult.to_evidence`) and the graders' own references.

    Args:
        task: the task (its ``checks`` and ``output_schema``).
        provider: the graders' model, or ``None`` for the run's own.
    """

    def __init__(self, task: Task, provider: Provider | None = None) -> None:
        self.task = task
        self.graders = {c.name: ModelGrader(provider, task=f"{task.goal.strip()}\n\nCRITERION TO JUDGE: {c.grader}",
                                            name=f"task_checks:{c.name}")
                        for c in task.checks if c.grader is not None}

    def __repr__(self) -> str:
        return f"TaskChecks({[c.name for c in self.task.checks]})"

    async def __call__(self, ctx: RunContext) -> Verdict:
        resp = ctx.last_response
        text = resp.text if resp is not None else ""
        output = None
        schema = self.task.output_schema
        if schema is not None and resp is not None:
            parsed = parse_output(resp, schema)  # the engine checked it already: this reads the value
            output = parsed.value if parsed.ok else None
        answer = TaskAnswer(text, output, ctx)
        results: list[CheckResult] = []
        for check in self.task.checks:
            if check.value is not None:
                results.append(check.evaluate(answer))
            elif check.grader is None:
                results.append(await check.call(answer))
        evidence: list[str] = []
        if all(r.ok for r in results):
            for check in self.task.checks:
                if check.grader is not None:
                    verdict = await self.graders[check.name](ctx)
                    results.append(CheckResult(check.name, verdict.ok, verdict.feedback))
                    evidence.extend(verdict.evidence)
        order = {c.name: i for i, c in enumerate(self.task.checks)}
        results.sort(key=lambda r: order[r.name])
        failed = [r for r in results if not r.ok]
        feedback = "; ".join(f"{r.name}: {r.reason or 'failed'}" for r in failed)
        return Verdict(not failed, feedback or "every acceptance check passed",
                       (*(r.to_evidence() for r in results), *evidence))


class Verifier(Middleware):
    """PostTurn check that completes the run or sends feedback (see the module doc).

    Args:
        check: a callable ``(ctx) -> Verdict`` (plain or async), e.g. a :class:`ModelGrader`.
        max_rejections: feedback rounds allowed before the run stops (0: stop at the first rejection).
        on_exhausted: ``"human"`` (WAITING_HUMAN, default) or ``"fail"`` (FAILED_TERMINAL).
        feedback_template: the user message sent after a rejection; ``{feedback}`` is the verdict's.
        name: middleware name (to have several verifiers in one chain).

    Raises:
        ValueError: ``on_exhausted`` is not ``"human"`` or ``"fail"``, or ``max_rejections`` < 0.
    """

    name = "verifier"

    def __init__(self, check: Check, *, max_rejections: int = 2, on_exhausted: str = "human",
                 feedback_template: str = "Your answer did not pass verification: {feedback}\n"
                                          "Fix it and answer again.",
                 name: str | None = None) -> None:
        if on_exhausted not in ("human", "fail"):
            raise ValueError(f"on_exhausted must be 'human' or 'fail', not {on_exhausted!r}")
        if max_rejections < 0:
            raise ValueError("max_rejections must not be negative")
        self.check = check
        self.max_rejections = max_rejections
        self.on_exhausted = on_exhausted
        self.feedback_template = feedback_template
        if name:
            self.name = name  # type: ignore[misc]  # instance override of the class-level name

    def __repr__(self) -> str:
        return (f"Verifier(check={self.check!r}, max_rejections={self.max_rejections}, "
                f"on_exhausted={self.on_exhausted!r})")

    @classmethod
    def for_task(cls, task: Task, *, provider: Provider | None = None) -> Verifier:
        """The verifier of a task's acceptance checks (``Agent.run_task`` puts it in the task's chain):
        :class:`TaskChecks` as its check, ``task.max_repairs`` feedback rounds, then the task's
        ``on_check_failure``; named ``task_checks`` (so it can sit beside a verifier of your own),
        and it cannot share a chain with ``planact``, which completes runs by its own checks."""
        return _TaskVerifier(TaskChecks(task, provider), max_rejections=task.max_repairs,
                             on_exhausted=task.on_check_failure,
                             feedback_template="Your answer did not pass the task's acceptance checks: {feedback}\n"
                                               "Fix it and answer again.")

    # the base hook is typed sync; the chain awaits an async override (checked when the chain is built)
    async def post_turn(self, ctx: RunContext) -> Complete | Continue | None:  # type: ignore[override]
        """Judge a turn that ended without tool calls; ``None`` for every other turn.

        Raises:
            StopRun: WAITING_HUMAN or FAILED_TERMINAL once ``max_rejections`` is spent.
            TypeError: the check returned something other than a :class:`Verdict` (fails the run).
        """
        resp = ctx.last_response
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return None
        verdict = self.check(ctx)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        if not isinstance(verdict, Verdict):
            raise TypeError(f"the verifier's check returned {type(verdict).__name__}, not a Verdict")
        state = ctx.state(self)
        state.setdefault("verdicts", []).append(verdict)
        if verdict.ok:
            evidence = verdict.evidence or (f"verifier:{self.middleware_name}:passed",)
            return Complete(evidence=evidence, detail=f"verified: {verdict.feedback or 'the check passed'}")
        rejections = state.get("rejections", 0)
        if rejections >= self.max_rejections:
            rejected = [v for v in state["verdicts"] if not v.ok]
            evidence = tuple(e for v in rejected for e in v.evidence)
            detail = (f"the verifier rejected {len(rejected)} answer(s); last reason: "
                      f"{verdict.feedback or 'none given'}")
            if self.on_exhausted == "fail":
                raise StopRun(StopReason.FAILED_TERMINAL, detail, evidence_refs=evidence,
                              error={"kind": "verification_failed", "message": detail,
                                     "reasons": [v.feedback for v in rejected]})
            raise StopRun(StopReason.WAITING_HUMAN, detail, evidence_refs=evidence,
                          required_decision="accept the last answer, or resume with guidance for the model")
        state["rejections"] = rejections + 1
        message = UserMessage(self.feedback_template.format(feedback=verdict.feedback or "no reason given"))
        return Continue(message=message,
                        reason=f"verifier rejected the answer ({rejections + 1} of {self.max_rejections})")


class _TaskVerifier(Verifier):
    """The verifier of a task's checks (:meth:`Verifier.for_task`)."""

    name = "task_checks"
    ordering = Ordering(conflicts={"planact": "PlanAct completes a run when its plan's nodes pass its checks; give a "
                                              "task run by PlanAct no acceptance checks (put them in "
                                              "PlanAct(check=...))"})
