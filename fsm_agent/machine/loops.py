"""Loop detection in the engine (seed 000 §5.4), applied by PreTurn and MidTurn through the host.

The run's :class:`~fsm_agent.LoopConfig` (``RunConfig.loop_detection``) is read on the history of
calls with their results in the transcript (:func:`fsm_agent.loops.find_loop`), so the verdict is
the same in a resume, a replay and a Temporal workflow, and nothing is kept between turns:

* **PreTurn** — when the latest calls end in a loop (a pattern of 1-3 calls that came back 3 times
  in a row with the same results), the context of the next model call ends with a warning (a user
  message starting :data:`~fsm_agent.loops.NOTICE_PREFIX`; it is not written to the transcript,
  which keeps what the user, the model and the tools said). The first answer to a loop is always
  this warning. With ``then="warn"`` (the seed's default) every model call whose history still
  ends in the loop gets it again.
* **MidTurn** — with ``then="block"`` or ``"stop"``, a proposed call that goes on with a loop the
  model was warned of (:func:`~fsm_agent.loops.continuing_calls`) is not run: ``block`` answers it
  with an error result the model reads (``metadata["denied_by"] == "loop_detection"``; such a call
  neither breaks nor extends the loop), ``stop`` ends the run FAILED_TERMINAL with
  :class:`~fsm_agent.errors.LoopStop` (error kind ``loop_detected``). It is checked after the
  session's permissions and before the middleware's ``on_tool_call``.

Each answer is a ``loop_detected`` event in the session log (``action``: ``warn``, ``block`` or
``stop``; ``pattern``, ``length``, ``count``, ``then``, and ``call_id`` for a call) and a
:class:`~fsm_agent.types.PolicyDecision` from ``loop_detection`` to the observers (``warn``,
``deny``, ``stop``). A chain with a middleware whose ``handles_loops`` is true (the
``loop_detection`` plugin) detects loops itself: the engine stands aside.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LoopStop
from ..loops import LOOP_DETECTION, Loop, LoopConfig, continuing_calls, find_loop, loop_notice
from ..types.content import ToolUseBlock
from ..types.events import PolicyDecision
from ..types.messages import ToolResultMessage, UserMessage
from .host import Host

__all__ = ["LoopWatch"]


class LoopWatch:
    """The engine's loop detection on its host (see the module doc)."""

    __slots__ = ("h",)

    def __init__(self, host: Host) -> None:
        self.h = host

    def config(self) -> LoopConfig | None:
        """The run's loop detection, or ``None``: none configured, or a middleware handles loops."""
        cfg = self.h.run_state.config.loop_detection
        if cfg is None or any(m.handles_loops for m in self.h.chain.middleware):
            return None
        return cfg

    async def at_pre_turn(self) -> None:
        """Warn the model in the context of its next call when its latest calls end in a loop."""
        cfg = self.config()
        if cfg is None:
            return
        h = self.h
        loop = find_loop(h.view._transcript, cfg)
        if loop is None:
            return
        text = loop_notice(loop, cfg.then)
        h.view.messages.append(UserMessage(text))
        await self._tell("warn", loop, cfg, "PreTurn", text)

    def continuing(self, calls: Sequence[ToolUseBlock]) -> dict[str, Loop]:
        """MidTurn: the ``calls`` (one response's) that go on with a loop the model was warned of, by
        id, when such a call is to be blocked or stop the run (``then`` is ``block`` or ``stop``)."""
        cfg = self.config()
        if cfg is None or cfg.then == "warn" or not calls:
            return {}
        loop = find_loop(self.h.view._transcript, cfg)
        if loop is None:
            return {}
        return dict.fromkeys(continuing_calls(loop, calls), loop)

    async def refuse(self, call: ToolUseBlock, loop: Loop) -> ToolResultMessage:
        """A call that goes on with ``loop``: its error result (``block``).

        Raises:
            LoopStop: ``then="stop"``: the run ends FAILED_TERMINAL.
        """
        cfg = self.h.run_state.config.loop_detection
        assert cfg is not None
        what = " -> ".join(loop.pattern)
        shown = "; ".join(repr(r) for r in loop.results if r) or "no output"
        came = (f"{what} came back {loop.count} times in a row{' (as a sequence)' if loop.length > 1 else ''} "
                f"with the same result each time ({shown})")
        if cfg.then == "stop":
            detail = (f"loop detected: {came}; after a warning the model proposed it again, so the run was "
                      "stopped before spending its budget")
            await self._tell("stop", loop, cfg, "MidTurn", detail, call)
            stop = LoopStop(detail, pattern=list(loop.pattern), count=loop.count, call_id=call.id)
            stop.middleware = LOOP_DETECTION  # type: ignore[attr-defined]  # who stopped it, for the observers
            raise stop
        text = (f"Not run: loop detected. {came}, and you were warned; running it again will not change "
                "that. Use the results you already have, change the arguments or the approach, or give your "
                "final answer.")
        await self._tell("block", loop, cfg, "MidTurn", text, call)
        return ToolResultMessage(call.id, text, is_error=True, name=call.name,
                                 metadata={"denied_by": LOOP_DETECTION})

    async def _tell(self, action: str, loop: Loop, cfg: LoopConfig, hook: str, reason: str,
                    call: ToolUseBlock | None = None) -> None:
        """The ``loop_detected`` log event; a :class:`PolicyDecision` for the observers (a stop's is
        sent by the driver when it takes the stop)."""
        h = self.h
        payload = {"action": action, "pattern": list(loop.pattern), "length": loop.length, "count": loop.count,
                   "then": cfg.then}
        if call is not None:
            payload["call_id"] = call.id
        h.record("loop_detected", payload)
        if action != "stop" and h.bus.wants(PolicyDecision):
            await h.bus.emit(PolicyDecision(h.session_id, h.run_state.turn, LOOP_DETECTION, hook,
                                            "warn" if action == "warn" else "deny", reason, call))
