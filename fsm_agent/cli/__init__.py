"""The ``fsm-agent`` command line (argparse; no business logic here).

Commands: ``run``, ``resume``, ``sessions list|show``, ``control``, ``serve``, ``worker``,
``diagram``, ``decode``, ``middleware list``, ``memory list|search|show|delete``.

Exit codes: 0 COMPLETED (or success); 2 a usage or configuration error (a session store that
cannot be opened among them), an unknown session, a session that cannot be resumed (or a decision
or budget that does not fit it: a resume that would stop again at once is refused before anything
starts), or a ``run --session-id`` that already exists; 3 WAITING_HUMAN; 4 PAUSED_BUDGET; 5 INTERRUPTED;
6 FAILED_RETRYABLE; 7 FAILED_TERMINAL; 8 CANCELLED; 1 anything else, e.g. a body ``decode``
could not parse (a message says what).

Sessions are kept in ``$FSM_AGENT_STORE`` (a SQLite path or a ``postgresql://`` DSN), default
``~/.fsm-agent/sessions.db``, so a stopped run can be resumed later by ``fsm-agent resume``.

``run`` and ``resume`` drain on SIGINT (Ctrl-C) and SIGTERM: the run ends INTERRUPTED with the
streamed text kept, a checkpoint and its lease released, the usual stop line and resume hint are
printed, and the exit code is 5, exactly as after ``fsm-agent control ID interrupt``. A second
signal stops the process at once; it still prints the stop line when the run reached one, else the
session id and the command that resumes it (exit 5).

The package, by concern (imports point down this list, never up):

- :mod:`~fsm_agent.cli.output`: what is printed about a run (the streaming printer, stop lines,
  resume hints, JSON) and :data:`EXIT_CODES`;
- :mod:`~fsm_agent.cli.factory`: the session store and the agent, built from flags and the
  environment (the embedded local model, default plugins, policy files, ``--approve-tools``);
- :mod:`~fsm_agent.cli.runs`, :mod:`~fsm_agent.cli.sessions`, :mod:`~fsm_agent.cli.serve`,
  :mod:`~fsm_agent.cli.offline`: the commands (``worker``'s is :mod:`fsm_agent.server.worker`'s);
- :mod:`~fsm_agent.cli.parser`: the argument parser, with the flags commands share on parent parsers;
- this module: :func:`main`, which parses, dispatches and turns errors into exit codes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from ..errors import FsmAgentError, SessionEndedError, SessionExistsError, UserError
from .factory import AgentFactory
from .factory import open_store as open_store  # public before the split
from .offline import decode_command, diagram_command, middleware_command
from .output import EXIT_CODES, Printer, report_ended, resume_hint
from .parser import build_parser
from .runs import Progress, after_second_interrupt, resume_command, run_command, session_exists, task_command
from .serve import serve_command
from .sessions import control_command, sessions_command

__all__ = ["EXIT_CODES", "console", "main"]

# the names these had when the command line was one module (tests and callers import them)
_AgentFactory = AgentFactory
_Printer = Printer
_build_parser = build_parser
_hint = resume_hint


def console() -> None:
    """The ``fsm-agent`` console script: :func:`main`, exiting with its code. After a Temporal
    worker's clean stop the process ends with ``os._exit`` once stdout and stderr are flushed (see
    :data:`fsm_agent.cli.temporal.EXIT_HARD`)."""
    code = main()
    from .temporal import EXIT_HARD

    if EXIT_HARD[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    progress = Progress()
    otel_shutdown = None
    try:
        if getattr(args, "otel", False):  # run, resume, serve, worker: OTLP/HTTP from the OTEL_* variables
            from ..otel import configure_otlp

            otel_shutdown = configure_otlp()
        if args.command == "run":
            return asyncio.run(run_command(args, out, err, progress))
        if args.command == "task":
            return asyncio.run(task_command(args, out, err, progress))
        if args.command == "resume":
            return asyncio.run(resume_command(args, out, err, progress))
        if args.command == "sessions":
            return asyncio.run(sessions_command(args, out, err))
        if args.command == "control":
            return asyncio.run(control_command(args, out, err))
        if args.command == "serve":
            return asyncio.run(serve_command(args, out, err))
        if args.command == "worker":
            return int(args.handler(args, out, err))
        if args.command == "diagram":
            return diagram_command(args, out, err)
        if args.command == "decode":
            return decode_command(args, out, err)
        if args.command == "middleware":
            return middleware_command(args, out, err)
        if args.command == "memory":
            from .memory import memory_command

            return asyncio.run(memory_command(args, out, err))
    except SessionExistsError as exc:  # Agent.run found the id taken (a race with the check in run_command)
        err.write(f"fsm-agent: {session_exists(exc.session_id)}\n")
        return 2
    except SessionEndedError as exc:  # resume of a session that ended for good: its stored result, nothing run
        report_ended(exc, err)
        return 2
    except UserError as exc:  # configuration, usage, unknown or final sessions
        err.write(f"fsm-agent: {exc}\n")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first drains the run)
        return after_second_interrupt(progress, args, out, err)
    except BrokenPipeError:  # `... | head`: the reader went away; that is not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0
    except FsmAgentError as exc:
        err.write(f"fsm-agent: {exc}\n")
        return 1
    except OSError as exc:  # a file named on the command line
        err.write(f"fsm-agent: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 1
    finally:
        if otel_shutdown is not None:
            otel_shutdown()  # flush the spans and metrics still batched
    return 2
