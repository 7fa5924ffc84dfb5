"""The ``fsm-agent`` argument parser (argparse): every command's flags, and nothing they do.

Flags that several commands share are declared once, on a parent parser (``add_help=False``)
given to each command's subparser through ``parents=``: :func:`common_flags` for every command
that reaches a run or its sessions (``run``, ``resume``, ``serve``, ``worker``, ``control``,
``sessions list|show``, ``diagram``), :func:`store_flag` for those that open the session store
with the default location (``worker`` declares its own ``--store``: it needs PostgreSQL),
:func:`agent_flags` for those that build the agent from flags (``run``, ``serve``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .._version import __version__
from ..plugins import DEFAULT_MIDDLEWARE

__all__ = ["AGENT_FLAGS", "agent_flags", "build_parser", "common_flags", "otel_flag", "store_flag"]

_Parents = list[argparse.ArgumentParser]


def common_flags() -> argparse.ArgumentParser:
    """The parent parser of the flags every command that reaches a run or its sessions shares
    (``run``, ``resume``, ``serve``, ``worker``, ``control``, ``sessions list|show``, ``diagram``).

    A flag that all of them take (a durable-execution backend, a tracing exporter) is added here
    once, and each of those commands has it: ``--temporal`` (with ``--namespace``, ``--task-queue``)."""
    from .temporal import add_temporal_flags

    p = argparse.ArgumentParser(add_help=False)
    add_temporal_flags(p)
    return p


def _with_agent(p: argparse.ArgumentParser) -> None:
    """``--agent MODULE:ATTR`` on a command that runs or reaches sessions on Temporal (the agent the
    workers serve), unless the command has one of its own already."""
    if "--agent" not in p._option_string_actions:
        p.add_argument("--agent", metavar="MODULE:ATTR",
                       help="with --temporal: the Agent the workers serve (they serve it under this name)")


def otel_flag() -> argparse.ArgumentParser:
    """The parent parser of ``--otel``, for the commands that run agents (``run``, ``resume``,
    ``serve``, ``worker``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--otel", action="store_true",
                   help="export OpenTelemetry GenAI traces and metrics over OTLP/HTTP, configured by the standard "
                        "OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, default http://localhost:4318; "
                        "OTEL_SERVICE_NAME ...); needs the extra fsm-agent[otel]")
    return p


def store_flag() -> argparse.ArgumentParser:
    """The parent parser of ``--store``, for the commands that open the session store."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--store", help="session store: SQLite path or postgresql:// DSN ($FSM_AGENT_STORE, "
                   "default ~/.fsm-agent/sessions.db)")
    return p


def _names(value: str) -> list[str]:
    """``--approve-tools calculator,clock``: one value, comma-separated names."""
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME or NAME,NAME... (no empty names)")
    return names


class _Parser(argparse.ArgumentParser):
    """The top-level parser: an argument no command knows is reported with the usage of the command
    (or subcommand) it was given to, not the top level's."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            message = f"unrecognized arguments: {' '.join(extras)}"
            if getattr(ns, "command", None) == "resume" and any(
                    e.startswith("--") and any(w in e for w in ("max", "budget", "cost", "limit", "iteration"))
                    for e in extras):
                message += ("; a resume raises a budget with --budget NAME=VALUE (iterations, wall_clock, tokens, "
                            "cost), or --max-iterations N, --timeout SECONDS, --max-tokens N")
            _command_parser(self, ns).error(message)
        return ns


def _command_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)command parser ``ns`` went through (``parser`` itself when none)."""
    found = parser
    while True:
        actions = [a for a in found._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            return found
        chosen = getattr(ns, actions[0].dest or "", None)
        nxt = actions[0].choices.get(chosen) if chosen is not None else None
        if nxt is None:
            return found
        found = nxt


def build_parser() -> argparse.ArgumentParser:
    """The ``fsm-agent`` parser; ``args.command`` names the command (and ``args.sessions_command``,
    ``args.middleware_command`` the subcommand; ``worker`` sets ``args.handler``). An argument the
    command does not take is an error printed with that command's usage (exit 2)."""
    p = _Parser(prog="fsm-agent", description="Run LLM agents as an explicit state machine.")
    p.add_argument("--version", action="version", version=f"fsm-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True,  # the metavar: a missing command names them all
                           metavar="{run,task,resume,sessions,control,serve,worker,diagram,decode,middleware,"
                                   "memory}")
    common, store, otel = common_flags(), store_flag(), otel_flag()
    _add_run(sub, [common, store, otel])
    _add_task(sub, [common, store, otel])
    _add_resume(sub, [common, store, otel])
    _add_sessions(sub, [common, store])
    _add_control(sub, [common, store])
    _add_diagram(sub, [common])
    _add_decode(sub)
    _add_serve(sub, [common, store, otel])

    from .worker import add_worker_command

    add_worker_command(sub, parents=[common, otel])
    _add_middleware(sub)
    from .memory import add_memory_command

    add_memory_command(sub, [store])
    return p


def agent_flags() -> argparse.ArgumentParser:
    """The parent parser of the flags that build the agent (the provider, the embedded model, tools,
    plugins, a policy file, approvals): ``run`` and ``serve`` take the same ones. Their ``args``
    attributes are :data:`fsm_agent.cli.factory.AGENT_FLAGS`."""
    r = argparse.ArgumentParser(add_help=False)
    r.add_argument("--provider", help="local (the embedded model, the default), openai, openai-responses, anthropic, "
                   "deepseek, qwen, openai-compatible (needs --base-url), llamacpp (a llama-server at --base-url); "
                   "default: $FSM_AGENT_PROVIDER, else local")
    r.add_argument("--base-url", help="provider base URL ($FSM_AGENT_BASE_URL)")
    r.add_argument("--model", help="the provider's model name ($FSM_AGENT_MODEL); with no provider, refused "
                                   "(the embedded model runs its own file: see --local-model)")
    r.add_argument("--api-key", help="API key ($FSM_AGENT_API_KEY, or the vendor's own variable)")
    r.add_argument("--local-model", metavar="PATH.gguf",
                   help="run this GGUF model on the embedded llama.cpp server instead of SmolLM2-135M "
                        "($FSM_AGENT_LOCAL_MODEL); tools need a 0.5B+ instruct model, e.g. Qwen2.5-0.5B-Instruct. "
                        "llama.cpp threads: $LLAMA_ARG_THREADS, default the usable CPUs minus one")
    r.add_argument("--tool", action="append", default=[], metavar="NAME",
                   help="enable a demo tool: calculator, clock (repeatable)")
    r.add_argument("--tool-mode", choices=["native", "constrained"], help="override the profile's tool-calling mode")
    r.add_argument("--system", help="system prompt")
    r.add_argument("--middleware", action="append", default=[], metavar="NAME",
                   help="add an installed middleware plugin (see `fsm-agent middleware list`)")
    r.add_argument("--no-default-middleware", action="store_true",
                   help=f"leave out the default plugins ({', '.join(DEFAULT_MIDDLEWARE)})")
    r.add_argument("--policy", metavar="FILE",
                   help="a tool policy file: allow / deny / ask rules per tool and argument (TOML, or JSON when "
                        "FILE ends in .json; format: docs/policy.md of the fsm_agent repository)")
    r.add_argument("--approve-tools", type=_names, action="extend", default=[], metavar="NAME[,NAME...]",
                   help="these tools (names or glob patterns, comma-separated; repeatable) need a person's "
                        "approval: the run stops WAITING_HUMAN (exit 3) until `fsm-agent resume ID --approve CALL_ID` "
                        "(serve: the review page's Approve, or POST /sessions/ID/approvals/CALL_ID)")
    r.add_argument("--hooks", metavar="FILE",
                   help="command hooks: commands run before and after each model call and tool call, given the "
                        "event as JSON on stdin; exit 1 of a before-hook denies (TOML, or JSON when FILE ends in "
                        ".json; format: docs/hooks.md of the fsm_agent repository)")
    r.add_argument("--hook", action="append", default=[], metavar="EVENT=COMMAND",
                   help="one command hook (EVENT: before_model_call, after_model_call, before_tool_call, "
                        "after_tool_call; COMMAND split like a shell, run without one, in the current directory; "
                        "5 s timeout, fail_open; repeatable; after those of --hooks)")
    return r


def permission_flags() -> argparse.ArgumentParser:
    """The parent parser of the new session's permissions (``run``, ``task``): a permissions file and
    ``--allow-tools`` (each narrows the other; docs/permissions.md)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--permissions", metavar="FILE",
                   help="the session's permissions: the tools it may call and argument scopes (paths, hosts, "
                        "amounts), TOML or JSON; checked by the engine for every call (docs/permissions.md)")
    p.add_argument("--allow-tools", type=_names, action="extend", default=None, metavar="NAME[,NAME...]",
                   help="the only tools the session may call (names or glob patterns, comma-separated; repeatable)")
    return p


def _add_task(sub: Any, parents: _Parents) -> None:
    t = sub.add_parser("task", parents=[*parents, agent_flags(), permission_flags()],
                       help="run a task file (goal, inputs, constraints, tools, budget, output schema, acceptance "
                            "checks) to a task result")
    t.add_argument("file", metavar="FILE.toml|FILE.json", help="the task definition (docs/tasks.md)")
    t.add_argument("--max-output-tokens", type=int, help="max tokens of each model answer")
    t.add_argument("--no-stream", action="store_true", help="do not stream model answers")
    t.add_argument("--session-id", help="id for the new session (default: random)")
    t.add_argument("--json", action="store_true", help="print the task result as JSON on stdout")
    t.add_argument("-v", "--verbose", action="store_true", help="show every state transition on stderr")


def _add_run(sub: Any, parents: _Parents) -> None:
    r = sub.add_parser("run", parents=[*parents, agent_flags(), permission_flags()], help="run one task to a stop reason")
    _with_agent(r)
    r.add_argument("task", help="what the agent should do")
    r.add_argument("--max-iterations", type=int, default=50, help="model calls per run (default 50)")
    r.add_argument("--timeout", type=float, default=600.0, help="wall-clock budget in seconds (default 600)")
    r.add_argument("--max-tokens", type=int, help="token budget over the run (input + output)")
    r.add_argument("--max-output-tokens", type=int, help="max tokens of each model answer")
    r.add_argument("--no-stream", action="store_true", help="do not stream model answers")
    r.add_argument("--session-id", help="id for the new session (default: random)")
    r.add_argument("--json", action="store_true", help="print the run's result as JSON on stdout")
    r.add_argument("-v", "--verbose", action="store_true", help="show every state transition on stderr")


def _add_resume(sub: Any, parents: _Parents) -> None:
    rs = sub.add_parser("resume", parents=parents, help="continue a stopped session")
    _with_agent(rs)
    rs.add_argument("session_id")
    rs.add_argument("--approve", action="append", default=[], metavar="CALL", help="approve a pending tool call")
    rs.add_argument("--reject", action="append", default=[], metavar="CALL", help="reject a pending tool call")
    rs.add_argument("--message", action="append", default=[], metavar="TEXT",
                    help="the model-facing reason of the --reject at the same position")
    rs.add_argument("--edit", action="append", default=[], metavar="CALL=JSON", help="run a call with new arguments")
    rs.add_argument("--respond", action="append", default=[], metavar="CALL=TEXT",
                    help="answer a call yourself instead of running the tool")
    rs.add_argument("--budget", action="append", default=[], metavar="NAME=VALUE",
                    help="raise a budget: iterations, wall_clock (s), tokens, cost (USD)")
    rs.add_argument("--max-iterations", type=int, metavar="N", help="the same as --budget iterations=N (as `run` takes it)")
    rs.add_argument("--timeout", type=float, metavar="SECONDS",
                    help="the same as --budget wall_clock=SECONDS (the whole run's, as `run` takes it)")
    rs.add_argument("--max-tokens", type=int, metavar="N", help="the same as --budget tokens=N (as `run` takes it)")
    rs.add_argument("--max-output-tokens", type=int, metavar="N",
                    help="max tokens of each model answer from now on (e.g. after an answer was cut)")
    rs.add_argument("--confirm-cancel", action="store_true", help="confirm a cancel waiting on side effects")
    rs.add_argument("--api-key", help="API key for the session's provider")
    rs.add_argument("--local-model", metavar="PATH.gguf",
                    help="for a session on the embedded model: the GGUF file to run (default: the run's own)")
    rs.add_argument("--json", action="store_true")
    rs.add_argument("-v", "--verbose", action="store_true")


def _add_sessions(sub: Any, parents: _Parents) -> None:
    s = sub.add_parser("sessions", help="list and inspect sessions")
    ss = s.add_subparsers(dest="sessions_command", required=True, metavar="{list,show}")
    sl = ss.add_parser("list", parents=parents)
    sl.add_argument("--limit", type=int, default=50)
    sl.add_argument("--json", action="store_true")
    sh = ss.add_parser("show", parents=parents)
    sh.add_argument("session_id")
    sh.add_argument("--events", action="store_true", help="print the event log as JSON lines")
    sh.add_argument("--turns", action="store_true",
                    help="print one line per turn (input, context hash, model call, tool calls, verification, "
                         "stop); with --json, one JSON object per turn")
    sh.add_argument("--json", action="store_true")


def _add_control(sub: Any, parents: _Parents) -> None:
    c = sub.add_parser("control", parents=parents, help="send a control event to a session (from any process)")
    _with_agent(c)
    c.add_argument("session_id")
    c.add_argument("kind", choices=["interrupt", "cancel", "steer", "followup", "restrict", "request_permissions"])
    c.add_argument("text", nargs="?", default="",
                   help="the new direction (steer) or request (followup); for restrict and request_permissions, "
                        "permissions as JSON or a TOML/JSON file's path (docs/permissions.md)")
    c.add_argument("--reason", default="", help="restrict, request_permissions: why (logged, shown to the approver)")


def _add_diagram(sub: Any, parents: _Parents) -> None:
    d = sub.add_parser("diagram", parents=parents, help="render the state machine as Mermaid")
    d.add_argument("--check", action="store_true", help="exit 1 when the committed diagram (or --output) differs")
    d.add_argument("--output", "-o", type=Path, default=None,
                   help="file to write or check (default: diagrams/agent_loop.mmd of the fsm_agent checkout, "
                        "wherever you run this; an installed copy needs --output)")
    d.add_argument("--stdout", action="store_true", help="print instead of writing")
    d.add_argument("--format", choices=["mermaid", "html", "svg"],
                   help="mermaid (the source), html (a self-contained page with the bundled Mermaid: opens offline "
                        "in any browser) or svg (rendered by a headless Chromium through Playwright); default: "
                        "from --output's suffix (.html, .svg), else mermaid")
    d.add_argument("--agent", metavar="MODULE:ATTR", help="show the middleware chains of this Agent")
    d.add_argument("--trace", metavar="EVENTS.jsonl", help="mark the path of a run (`fsm-agent sessions show ID --events`)")
    d.add_argument("--plan", metavar="EVENTS.jsonl",
                   help="render the run's PlanAct plan as a Mermaid flowchart instead (from `sessions show ID --events`)")


def _add_decode(sub: Any) -> None:
    dc = sub.add_parser("decode", help="decode a recorded provider response body (stdin) to JSON")
    dc.add_argument("--protocol", required=True, choices=["openai-chat", "openai-responses", "anthropic"])
    dc.add_argument("--events", action="store_true", help="print each stream event as one JSON line")
    dc.add_argument("--status", type=int, metavar="N",
                    help="the HTTP status the body came with; from 400 up, print the typed error the HTTP path "
                         "raises for it (class, kind, retryable, retry_after, message) as JSON and exit 0")
    dc.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                    help="a response header given with --status (Retry-After, x-should-retry; repeatable)")
    dc.add_argument("input", nargs="?", default="-", help="file to read (default: stdin)")


def _add_serve(sub: Any, parents: _Parents) -> None:
    sv = sub.add_parser("serve", parents=[*parents, agent_flags()],
                        help="serve sessions over HTTP: runs, a live event stream, approvals, the review page")
    sv.add_argument("--agent", metavar="MODULE:ATTR",
                    help="the Agent to serve (an Agent, or a callable returning one); default: the agent `run` "
                         "builds from the same flags (--provider, --tool, --policy, --approve-tools, --middleware "
                         "...), with none the embedded model with the default plugins")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; any other needs tokens)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    sv.add_argument("--tokens", metavar="FILE",
                    help="bearer tokens, one TENANT:TOKEN per line ($FSM_AGENT_TOKENS_FILE, or "
                         "$FSM_AGENT_TOKENS=tenant:token,...); without tokens only loopback is served")
    sv.add_argument("--tenant-permissions", metavar="FILE",
                    help="each tenant's default session permissions: a TOML/JSON table per tenant name "
                         "(`default` without --tokens), in the permissions format (docs/permissions.md); a "
                         "request's own permissions narrow them")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="allow cross-origin calls from this origin (repeatable; default: CORS off)")
    sv.add_argument("--local-runs", action="store_true",
                    help="with a postgresql:// store: run in this process instead of queueing for `fsm-agent worker`")
    sv.add_argument("--a2a", metavar="NAME",
                    help="also serve the agent over A2A 1.0 (JSON-RPC at /a2a, its card at "
                         "/.well-known/agent-card.json) under this name; see docs/a2a.md")
    sv.add_argument("--a2a-description", metavar="TEXT", default="An fsm_agent agent.",
                    help="what the agent does, for its A2A card (with --a2a)")


def _add_middleware(sub: Any) -> None:
    m = sub.add_parser("middleware", help="installed middleware plugins")
    ms = m.add_subparsers(dest="middleware_command", required=True, metavar="{list}")
    ms.add_parser("list")
