"""The ``fsm-agent`` command line (argparse; no business logic here).

Exit codes: 0 COMPLETED; 2 usage or configuration error; 3 WAITING_HUMAN;
4 PAUSED_BUDGET; 5 INTERRUPTED; 6 FAILED_RETRYABLE; 7 FAILED_TERMINAL;
8 CANCELLED; 1 anything else (a message says what).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from ._version import __version__
from .errors import ConfigurationError, FsmAgentError
from .types.run import StopReason

__all__ = ["EXIT_CODES", "main"]

EXIT_CODES: dict[StopReason, int] = {
    StopReason.COMPLETED: 0,
    StopReason.WAITING_HUMAN: 3,
    StopReason.PAUSED_BUDGET: 4,
    StopReason.INTERRUPTED: 5,
    StopReason.FAILED_RETRYABLE: 6,
    StopReason.FAILED_TERMINAL: 7,
    StopReason.CANCELLED: 8,
}


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


class _Printer:
    """Observer that streams the answer to stdout and tool activity to stderr."""

    def __init__(self, out: TextIO, err: TextIO, quiet: bool) -> None:
        self.out, self.err, self.quiet = out, err, quiet
        self.open_line = False

    def on_model_event(self, ev: Any) -> None:
        from .types.stream import TextDelta

        if isinstance(ev.event, TextDelta):
            self.out.write(ev.event.text)
            self.out.flush()
            self.open_line = not ev.event.text.endswith("\n")

    def _nl(self) -> None:
        if self.open_line:
            self.out.write("\n")
            self.out.flush()
            self.open_line = False

    def on_tool_started(self, ev: Any) -> None:
        self._nl()
        args = orjson.dumps(ev.call.input).decode()
        self.err.write(f"→ tool {ev.call.name}({args})\n")

    def on_tool_finished(self, ev: Any) -> None:
        mark = "✗" if ev.result.is_error else "←"
        text = ev.result.text
        if len(text) > 300:
            text = text[:300] + "…"
        self.err.write(f"{mark} {ev.call.name}: {text} ({ev.duration_s:.2f} s)\n")

    def on_transition(self, ev: Any) -> None:
        if not self.quiet:
            self.err.write(f"  [{ev.from_state} --{ev.trigger}--> {ev.to_state}] {ev.reason}\n")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsm-agent", description="Run LLM agents as an explicit state machine.")
    p.add_argument("--version", action="version", version=f"fsm-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run one task to a stop reason")
    r.add_argument("task", help="what the agent should do")
    r.add_argument("--provider", help="openai, openai-responses, anthropic, deepseek, qwen, openai-compatible, "
                   "llamacpp (default: $FSM_AGENT_PROVIDER, else the embedded local model)")
    r.add_argument("--base-url", help="provider base URL ($FSM_AGENT_BASE_URL)")
    r.add_argument("--model", help="model name ($FSM_AGENT_MODEL)")
    r.add_argument("--api-key", help="API key ($FSM_AGENT_API_KEY, or the vendor's own variable)")
    r.add_argument("--tool", action="append", default=[], metavar="NAME",
                   help="enable a demo tool: calculator, clock (repeatable)")
    r.add_argument("--tool-mode", choices=["native", "constrained"], help="override the profile's tool-calling mode")
    r.add_argument("--system", help="system prompt")
    r.add_argument("--max-iterations", type=int, default=50, help="model calls per run (default 50)")
    r.add_argument("--timeout", type=float, default=600.0, help="wall-clock budget in seconds (default 600)")
    r.add_argument("--max-tokens", type=int, help="token budget over the run (input + output)")
    r.add_argument("--max-output-tokens", type=int, help="max tokens of each model answer")
    r.add_argument("--no-stream", action="store_true", help="do not stream model answers")
    r.add_argument("--json", action="store_true", help="print the run's result as JSON on stdout")
    r.add_argument("-v", "--verbose", action="store_true", help="show every state transition on stderr")

    d = sub.add_parser("diagram", help="render the state machine as Mermaid")
    d.add_argument("--check", action="store_true", help="exit 1 when the committed diagram differs")
    d.add_argument("--output", "-o", type=Path, default=None, help="file to write (default diagrams/agent_loop.mmd)")
    d.add_argument("--stdout", action="store_true", help="print instead of writing")
    return p


def _provider_config(args: argparse.Namespace, base_url: str | None) -> Any:
    from .providers.base import ProviderConfig, ToolMode

    return ProviderConfig(
        model=args.model or _env("FSM_AGENT_MODEL"),
        base_url=base_url,
        api_key=args.api_key or _env("FSM_AGENT_API_KEY"),
        tool_mode=ToolMode(args.tool_mode) if args.tool_mode else None,
    )


async def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .agent import Agent
    from .local import LocalLlamaServer
    from .machine.context import RunConfig
    from .providers.profiles import create_provider
    from .tools.demo import DEMO_TOOLS
    from .types.codec import unstructure

    tools = []
    for name in args.tool:
        if name not in DEMO_TOOLS:
            raise ConfigurationError(f"unknown tool {name!r}; demo tools: {', '.join(DEMO_TOOLS)}")
        tools.append(DEMO_TOOLS[name])
    provider_name = args.provider or _env("FSM_AGENT_PROVIDER")
    base_url = args.base_url or _env("FSM_AGENT_BASE_URL")
    if provider_name is None and base_url:
        provider_name = "openai-compatible"
    server = None
    if provider_name is None:
        err.write("fsm-agent: no provider configured; using the embedded local model (SmolLM2-135M via llama.cpp)\n")
        server = LocalLlamaServer(log=lambda m: err.write(f"fsm-agent: {m}\n"))
        await asyncio.to_thread(server.start)
        provider_name, base_url = "llamacpp", server.base_url
    try:
        provider = create_provider(provider_name, _provider_config(args, base_url))
        config = RunConfig(
            max_iterations=args.max_iterations,
            max_wall_clock=args.timeout,
            max_tokens=args.max_tokens,
            max_output_tokens=args.max_output_tokens,
            stream=not args.no_stream,
        )
        observers = [] if args.json else [_Printer(out, err, quiet=not args.verbose)]
        agent = Agent(provider, tools=tools, system_prompt=args.system, config=config, observers=observers)
        try:
            result = await agent.run(args.task)
        finally:
            await provider.aclose()
    finally:
        if server is not None:
            server.stop()
    if args.json:
        out.write(orjson.dumps(unstructure(result), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        if observers and observers[0].open_line:
            out.write("\n")
        if not result.output and result.stop.reason is StopReason.COMPLETED:
            out.write("(the model gave no text)\n")
        u = result.usage
        est = " (estimated)" if u.estimated else ""
        cost = f", ${result.cost_usd:.6f}" if result.cost_usd else ""
        err.write(f"stop: {result.stop.reason.value} — {result.stop.detail}\n")
        err.write(f"usage: {u.input_tokens} input + {u.output_tokens} output tokens{est}{cost}; "
                  f"{result.turns} model call(s), {result.tool_calls} tool call(s), {result.duration_s:.1f} s\n")
        if result.stop.error:
            err.write(f"error: {result.stop.error.get('message')}\n")
    return EXIT_CODES[result.stop.reason]


def _diagram(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .diagrams import DEFAULT_PATH, check_diagram, render_machine, write_diagram

    path = args.output or DEFAULT_PATH
    if args.check:
        problem = check_diagram(path)
        if problem:
            err.write(problem + "\n")
            return 1
        err.write(f"{path} is up to date\n")
        return 0
    if args.stdout:
        out.write(render_machine())
        return 0
    write_diagram(path)
    err.write(f"wrote {path}\n")
    return 0


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return asyncio.run(_run(args, out, err))
        if args.command == "diagram":
            return _diagram(args, out, err)
    except ConfigurationError as exc:
        err.write(f"fsm-agent: {exc}\n")
        return 2
    except KeyboardInterrupt:
        err.write("fsm-agent: interrupted\n")
        return EXIT_CODES[StopReason.INTERRUPTED]
    except FsmAgentError as exc:
        err.write(f"fsm-agent: {exc}\n")
        return 1
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
