"""What the command line prints about a run: the streamed answer, the stop lines, the resume hint, JSON.

:class:`Printer` is the observer that streams a run to the terminal; :func:`report` prints its
result (or its JSON) and returns the exit code of :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from ..errors import SessionEndedError
from ..types.run import StopReason

__all__ = ["EXIT_CODES", "Printer", "report", "report_ended", "resume_hint", "stop_lines", "task_report"]

EXIT_CODES: dict[StopReason, int] = {
    StopReason.COMPLETED: 0,
    StopReason.WAITING_HUMAN: 3,
    StopReason.PAUSED_BUDGET: 4,
    StopReason.INTERRUPTED: 5,
    StopReason.FAILED_RETRYABLE: 6,
    StopReason.FAILED_TERMINAL: 7,
    StopReason.CANCELLED: 8,
}
"""The process exit code of each stop reason (2 and 1 are usage and other errors: see :mod:`fsm_agent.cli`)."""


class Printer:
    """Observer that streams the answer to stdout and tool activity (and plan changes) to stderr.

    Only the Model phase's call is the answer: calls a plugin makes in other phases (a planner, a
    grader, a summarizer, through ``ctx.call_provider``) stream to observers too, and are not printed."""

    def __init__(self, out: TextIO, err: TextIO, verbose: bool) -> None:
        self.out, self.err, self.verbose = out, err, verbose
        self.open_line = False

    def on_model_event(self, ev: Any) -> None:
        text = getattr(ev.event, "text", None)
        if ev.event.TAG == "text_delta" and text and ev.phase == "Model":
            self.out.write(text)
            self.out.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        self._nl()

    def _nl(self) -> None:
        if self.open_line:
            self.out.write("\n")
            self.out.flush()
            self.open_line = False

    def on_tool_started(self, ev: Any) -> None:
        self._nl()
        self.err.write(f"→ tool {ev.call.name}({orjson.dumps(ev.call.input).decode()})\n")

    def on_tool_finished(self, ev: Any) -> None:
        mark = "✗" if ev.result.is_error else "←"
        text = ev.result.text
        if len(text) > 300:
            text = text[:300] + "…"
        self.err.write(f"{mark} {ev.call.name}: {text} ({ev.duration_s:.2f} s)\n")

    def on_plan_updated(self, ev: Any) -> None:
        self._nl()
        self.err.write(f"plan v{ev.plan.version}: {ev.reason}\n")

    def on_transition(self, ev: Any) -> None:
        if self.verbose:
            self.err.write(f"  [{ev.from_state} --{ev.trigger}--> {ev.to_state}] {ev.reason}\n")

    def on_budget_warning(self, ev: Any) -> None:
        self.err.write(f"! budget {ev.budget}: {ev.used:g} of {ev.limit:g} used\n")

    def on_model_retry(self, ev: Any) -> None:
        self._nl()
        status = f" (HTTP {ev.status})" if ev.status is not None else ""
        hint = ", as the server asked" if ev.server_hint else ""
        self.err.write(f"! model call failed: {ev.kind}{status}; retry {ev.attempt} in {ev.delay_s:.3g} s{hint}\n")


def report(result: Any, args: argparse.Namespace, printer: Printer | None, out: TextIO, err: TextIO,
           settings: dict[str, Any] | None = None) -> int:
    """Print a run's result: its JSON on ``out`` with ``--json``, else the end of the streamed
    answer on ``out`` and the stop, usage and session lines on ``err``. Returns the exit code.

    When the provider's content filter blocked the answer (error kind ``content_filtered``), the
    answer is the safety message (``RunConfig.content_filter_message``): with a ``printer`` (the
    answer streamed here) it is printed on ``out`` after whatever had streamed. ``printer`` is
    ``None`` where the caller printed ``result.output`` itself (a run on Temporal)."""
    from ..types.codec import unstructure

    if args.json:
        out.write(orjson.dumps(unstructure(result), option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_CODES[result.stop.reason]
    if printer is not None and printer.open_line:
        out.write("\n")
        printer.open_line = False
    error = result.stop.error or {}
    if printer is not None and error.get("kind") == "content_filtered" and result.output:
        out.write(result.output + "\n")  # the safety message is the answer; nothing of it streamed
    if not result.output and result.stop.reason is StopReason.COMPLETED:
        out.write("(the model gave no text)\n")
    u = result.usage
    est = " (estimated)" if u.estimated else ""
    cost = f", ${result.cost_usd:.6f}" if result.cost_usd else ""
    stop = result.stop
    pending = [(p.call.id, p.call.name, p.call.input, p.reason) for p in stop.pending_actions]
    stop_lines(stop.reason, stop.detail, stop.error, pending, err,
               usage=f"usage: {u.input_tokens} input + {u.output_tokens} output tokens{est}{cost}; "
                     f"{result.turns} model call(s), {result.tool_calls} tool call(s), {result.duration_s:.1f} s")
    hint = resume_hint(result.session_id, stop.reason, [p[0] for p in pending], stop.budget, stop.error, settings)
    err.write(f"session: {result.session_id}" + (f" (continue with: {hint})" if hint else "") + "\n")
    return EXIT_CODES[stop.reason]


def task_report(result: Any, args: argparse.Namespace, printer: Printer | None, out: TextIO, err: TextIO,
                settings: dict[str, Any] | None = None) -> int:
    """Print a :class:`~fsm_agent.TaskResult`: its JSON on ``out`` with ``--json``; else on ``err`` the
    outcome, each check, then the run's stop, usage and session lines (as :func:`report`), and on
    ``out`` the validated output once the task succeeded (JSON for a task with an output schema, else
    the answer's text). Returns the stop's exit code, or that of FAILED_TERMINAL for a task that
    completed without passing its checks."""
    import io

    code = EXIT_CODES[result.stop.reason]
    if result.stop.reason is StopReason.COMPLETED and not result.ok:
        code = EXIT_CODES[StopReason.FAILED_TERMINAL]
    if args.json:
        out.write(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return code
    if printer is not None and printer.open_line:
        err.write("\n")
        printer.open_line = False
    err.write(f"task: {result.outcome.value} — {result.detail}\n")
    for c in result.checks:
        err.write(f"check {'passed' if c.ok else 'FAILED'}: {c.name}" + (f" ({c.reason})" if c.reason else "") + "\n")
    report(result.run, argparse.Namespace(**{**vars(args), "json": False}), None, io.StringIO(), err, settings)
    if result.ok:
        output = result.output
        out.write((output if isinstance(output, str) else orjson.dumps(output).decode()) + "\n")
    return code


def stop_lines(reason: StopReason, detail: str, error: dict[str, Any] | None,
               pending: Sequence[tuple[str, str, Any, str]], err: TextIO, usage: str | None = None) -> None:
    """The ``stop:`` line (with ``usage:``, ``error:`` and ``pending:`` lines) of a stopped run."""
    if error and error.get("message") and error["message"] not in detail:
        said = f"error ({error.get('kind', 'error')}): {error['message']}"
    else:
        said = ""
    err.write(f"stop: {reason.value} — {detail}\n")
    if usage:
        err.write(usage + "\n")
    if said:
        err.write(said + "\n")
    for cid, name, arguments, why in pending:
        err.write(f"pending: {cid} {name}({orjson.dumps(arguments).decode()}) — {why}\n")


def resume_hint(sid: str, reason: StopReason, pending: Sequence[str], budget: str | None,
                error: dict[str, Any] | None, settings: dict[str, Any] | None = None) -> str | None:
    """The ``fsm-agent resume`` command that continues a session stopped for ``reason`` (only what
    ``resume`` can change), or ``None`` when it cannot be resumed."""
    if reason is StopReason.WAITING_HUMAN:
        approve = " ".join(f"--approve {cid}" for cid in pending) or "--approve CALL"
        return (f"fsm-agent resume {sid} {approve}; or, per call, --reject CALL --message TEXT | "
                f"--edit CALL='{{...}}' | --respond CALL=TEXT")
    if reason is StopReason.PAUSED_BUDGET:
        return f"fsm-agent resume {sid} --budget {budget or 'iterations'}=N"
    if reason is StopReason.INTERRUPTED:
        return f"fsm-agent resume {sid}"
    if reason is StopReason.FAILED_RETRYABLE:
        error = error or {}
        if error.get("kind") == "output_truncated":
            used = error.get("max_tokens")
            more = f" (more than {used})" if isinstance(used, int) else ""
            return f"fsm-agent resume {sid} --max-output-tokens N{more}"
        base_url = (settings or {}).get("base_url")
        if error.get("kind") == "connection" and base_url:
            return (f"fsm-agent resume {sid} once {base_url} answers; a resume keeps the session's provider and "
                    "base URL (a wrong URL needs a new run)")
        return f"fsm-agent resume {sid}"
    return None


def report_ended(exc: SessionEndedError, err: TextIO) -> None:
    """``resume`` of a session that ended for good: say so, with its stored stop (nothing ran)."""
    err.write(f"fsm-agent: session {exc.session_id} already ended {exc.reason.value}; nothing was run again "
              f"(fsm-agent sessions show {exc.session_id} for its record)\n")
    if exc.result is not None:
        stop = exc.result.stop
        stop_lines(stop.reason, stop.detail, stop.error, [], err)
