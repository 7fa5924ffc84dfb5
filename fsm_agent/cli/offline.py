"""The commands that need neither a session store nor a model: ``diagram``, ``decode``, ``middleware list``."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TextIO

import orjson

from ..errors import ConfigurationError, FsmAgentError

__all__ = ["decode_command", "diagram_command", "middleware_command"]


def diagram_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``diagram``: write (or ``--check``, or print) the machine's Mermaid diagram, with an Agent's
    chains or a run's path drawn, or a session's plan (``--plan``); as Mermaid, a self-contained HTML
    page or an SVG (``--format``, or the ``--output`` suffix: ``.html``, ``.svg``). Returns 0, or 1
    when ``--check`` finds the file out of date.

    Raises:
        ConfigurationError: a trace with no transitions, a plan file that cannot be read or holds no
            plan, ``--check`` with a format other than Mermaid, an SVG with no Playwright or Chromium.
    """
    from ..diagrams import chains_of, check_diagram, default_diagram_path, render_machine, trace_of, write_diagram

    if args.plan:
        return _plan_diagram(args, out, err)

    if args.check:
        if getattr(args, "format", None) not in (None, "mermaid"):
            raise ConfigurationError("--check compares the committed Mermaid file; leave out --format")
        path = (args.output or default_diagram_path()).resolve()
        problem = check_diagram(path)
        if problem:
            err.write(problem + "\n")
            return 1
        err.write(f"{path} is up to date\n")
        return 0
    from ..diagram_files import format_of

    fmt = format_of(args.output, getattr(args, "format", None))
    chains = chains_of(args.agent) if args.agent else None
    trace = trace_of(Path(args.trace)) if args.trace else None
    if trace is not None and not trace:
        raise ConfigurationError(f"--trace {args.trace} holds no transition events (an empty file?); produce it "
                                 "with `fsm-agent sessions show ID --events > FILE`")
    if chains is None and trace is None and not args.stdout and fmt == "mermaid":
        path = write_diagram(args.output)
        err.write(f"wrote {path}\n")
        return 0
    title = args.agent or (Path(args.trace).name if args.trace else None)
    text = render_machine(chains=chains, trace=trace, title=title)
    return _write(text, fmt, title or "fsm_agent loop", args, out, err)


def _write(text: str, fmt: str, title: str, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Write the Mermaid ``text`` as ``fmt`` (``mermaid``, ``html``: self-contained, ``svg``) to
    ``--output`` or stdout; returns 0."""
    if fmt != "mermaid":
        from ..diagram_files import render_html, render_svg

        text = render_html(text, title) if fmt == "html" else render_svg(text, title)
    if args.output:
        args.output.write_text(text, encoding="utf-8")
        err.write(f"wrote {args.output.resolve()}\n")
    else:
        out.write(text)
    return 0


def _plan_diagram(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``diagram --plan EVENTS.jsonl``: the session's PlanAct plan (its last ``plan_updated``) as a flowchart."""
    from ..diagrams import latest_plan, render_plan

    if args.check or args.agent or args.trace:
        raise ConfigurationError("--plan renders a session's plan on its own; leave out --check, --agent and --trace")
    path = Path(args.plan)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from exc
    events = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ConfigurationError(f"{path}:{n}: not a JSON event line ({exc}); produce the file with "
                                         "`fsm-agent sessions show ID --events`") from exc
    plan = latest_plan(events)
    if plan is None:
        raise ConfigurationError(f"{path} holds no plan_updated event: the session ran without the planact plugin "
                                 "(or this is not its `fsm-agent sessions show ID --events` output)")
    from ..diagram_files import format_of

    return _write(render_plan(plan), format_of(args.output, getattr(args, "format", None)),
                  f"plan v{plan.version}", args, out, err)


def decode_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``decode``: never a traceback. Whatever the body, the outcome is JSON on stdout or one line on
    stderr; an exception of fsm_agent's own (a bug) is reported in one line too, with exit 1."""
    from ..providers.decode import decode_body

    headers: dict[str, str] = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ConfigurationError(f"--header {h!r}: give NAME: VALUE (e.g. 'Retry-After: 30')")
        headers[name.strip().lower()] = value.strip()
    if headers and args.status is None:
        raise ConfigurationError("--header goes with --status (the headers of an error response)")
    if args.status is not None and not 100 <= args.status <= 599:
        raise ConfigurationError(f"--status {args.status}: an HTTP status is 100 to 599")
    if args.input == "-":
        raw = sys.stdin.buffer.read()
    else:
        try:
            raw = Path(args.input).read_bytes()
        except OSError as exc:
            raise ConfigurationError(f"cannot read {args.input}: {exc.strerror or exc}") from None
    try:
        return decode_body(args.protocol, raw, out=out, err=err, events=args.events, status=args.status,
                           headers=headers)
    except (FsmAgentError, OSError):
        raise  # main reports them (and a closed stdout)
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one line, not a traceback
        err.write(f"fsm-agent decode: internal error ({type(exc).__name__}: {str(exc)[:500]}); please report it "
                  "with the body\n")
        return 1


def middleware_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``middleware list``: each installed plugin with its ordering, hooks and summary (or why it is
    broken); returns 0."""
    from ..plugins import discover, load_plugin

    plugins = discover()
    if not plugins:
        out.write("no middleware plugins installed\n")
        return 0
    for p in plugins:
        try:
            cls = load_plugin(p.name)
            o = cls.ordering
            parts = []
            if o.position:
                parts.append(o.position)
            parts += [f"wraps {', '.join(o.wraps)}"] if o.wraps else []
            parts += [f"wrapped_by {', '.join(o.wrapped_by)}"] if o.wrapped_by else []
            parts += [f"requires {', '.join(o.requires)}"] if o.requires else []
            hooks = [h for h in ("pre_turn", "wrap_model_call", "on_model_event", "on_tool_call", "wrap_tool_call",
                                 "post_turn") if getattr(cls, h) is not getattr(cls.__mro__[-2], h, None)]
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
            out.write(f"{p.name:<16} {p.target:<44} [{p.distribution}] failure={getattr(cls.failure_policy, 'value', cls.failure_policy)}"
                      f" order={'; '.join(parts) or 'as listed'}\n"
                      f"{'':<16} hooks: {', '.join(hooks) or '-'} — {doc}\n")
        except ConfigurationError as exc:
            out.write(f"{p.name:<16} {p.target:<44} [{p.distribution}] BROKEN: {exc}\n")
    return 0
