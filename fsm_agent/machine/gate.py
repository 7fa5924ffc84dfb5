"""The session's permissions in the engine (:mod:`fsm_agent.permissions`): applied with no plugin.

* **PreTurn** (:meth:`PermissionGate.at_pre_turn`, after Cancel / Interrupt / Steer): queued
  ``restrict`` controls narrow the permissions (a request still waiting is narrowed too); a
  ``request_permissions`` control becomes the pending request (a newer one replaces it); a
  person's decision on the pending request applies it (``approve``: the requested permissions
  replace the session's) or drops it (``reject``); a request with no decision stops the run
  WAITING_HUMAN with it pending. Then, after the PreTurn middleware
  (:meth:`PermissionGate.offer`), the model is offered only the tools the session may call,
  whatever a plugin put in ``ctx.settings.active_tools``.
* **MidTurn**: queued ``restrict`` controls are applied before any call is decided
  (:meth:`PermissionGate.take_restrictions`), and every call is checked before it runs
  (:meth:`PermissionGate.denied`): before the middleware's ``on_tool_call`` (a plugin cannot let
  it through, nor ask a person about it), again after a plugin's ``Edit``, and before a person's
  approval or edit runs it. A call outside the permissions gets an error result naming the
  permission, its ledger entry is ``rejected``, and a ``permission_denied`` event is logged.

Every change is logged (``permissions_narrowed``, ``permissions_requested``, ``permissions_widened``,
``permissions_request_rejected``) and checkpointed at once: a restriction survives a crash. All of it
goes through the host (its ``take``, ``record``, journal and port), so it replays and runs on any
host.
"""

from __future__ import annotations

from typing import Any

from ..permissions import PermissionRequest, Permissions, read_control_text
from ..store.base import ControlKind, ControlRecord
from ..types.content import ToolUseBlock
from ..types.messages import ToolResultMessage
from ..types.run import StopReason
from .host import Host
from .outcome import Outcome, Stop
from .phases import Phase

__all__ = ["PermissionGate"]


class PermissionGate:
    """The session's permissions at PreTurn and MidTurn (see the module doc)."""

    __slots__ = ("h",)

    def __init__(self, host: Host) -> None:
        self.h = host

    # -- control events ---------------------------------------------------------------------------
    async def at_pre_turn(self) -> Outcome | None:
        """Apply queued restrictions and requests and a decision on the pending request; the
        WAITING_HUMAN stop of a request no person has decided yet, else ``None``."""
        h = self.h
        run = h.run_state
        changed = False
        for c in await h.take(ControlKind.RESTRICT, ControlKind.REQUEST_PERMISSIONS):
            changed = (self._restrict(c) if c.kind is ControlKind.RESTRICT else self._request(c)) or changed
        request = run.permission_request
        if request is not None:
            decision = run.decisions.pop(request.request_id, None)
            if decision is not None:
                run.permission_request = None
                changed = True
                if decision.kind == "approve":
                    run.permissions = request.permissions
                    h.record("permissions_widened", {"request_id": request.request_id, "reason": request.reason,
                                                     "permissions": request.permissions.to_dict(),
                                                     "approved_by": "a person's decision"})
                else:
                    h.record("permissions_request_rejected", {"request_id": request.request_id,
                                                              "decision": decision.kind, "message": decision.message})
        if changed:
            await self._commit()
        request = run.permission_request
        if request is None:
            return None
        why = f" ({request.reason})" if request.reason else ""
        return Stop(StopReason.WAITING_HUMAN,
                    f"a request to widen this session's permissions{why} waits for a person: approve or reject "
                    f"{request.request_id} ({request.permissions.describe()})",
                    {"pending_actions": (request.pending_action(),),
                     "required_decision": "approve or reject the requested permissions",
                     "last_safe_point": Phase.PRE_TURN.value})

    async def take_restrictions(self) -> None:
        """Apply the ``restrict`` controls queued now (before a tool call is decided)."""
        if any([self._restrict(c) for c in await self.h.take(ControlKind.RESTRICT)]):
            await self._commit()

    def _restrict(self, control: ControlRecord) -> bool:
        h = self.h
        run = h.run_state
        try:
            restriction, reason = read_control_text(control.text, "restriction")
        except Exception as exc:  # noqa: BLE001 - a malformed narrowing fails closed: no tool at all
            restriction, reason = Permissions(()), f"a malformed restriction was received ({exc}): no tool may run"
        base = run.permissions if run.permissions is not None else Permissions()
        run.permissions = base.narrow(restriction, reason)
        request = run.permission_request
        if request is not None:
            run.permission_request = PermissionRequest(request.request_id,
                                                       request.permissions.narrow(restriction, reason), request.reason)
        h.record("permissions_narrowed", {"control_id": control.control_id, "reason": reason,
                                          "restriction": restriction.to_dict(),
                                          "permissions": run.permissions.to_dict()})
        return True

    def _request(self, control: ControlRecord) -> bool:
        h = self.h
        run = h.run_state
        try:
            wanted, reason = read_control_text(control.text, "permissions")
        except Exception as exc:  # noqa: BLE001 - a malformed request widens nothing
            h.record("control_dropped", {"kind": control.kind.value, "control_id": control.control_id,
                                         "reason": f"malformed permission request: {exc}"})
            return False
        old = run.permission_request
        request_id = f"perm_{control.control_id}"
        run.permission_request = PermissionRequest(request_id, wanted, reason)
        h.record("permissions_requested", {"request_id": request_id, "reason": reason,
                                           "permissions": wanted.to_dict(),
                                           "supersedes": old.request_id if old is not None else None})
        return True

    async def _commit(self) -> None:
        """Checkpoint at once, at the phase the run is in: a change of permissions survives a crash."""
        h = self.h
        j = h.journal
        if j is None:
            return
        run = h.run_state
        run.state = h.machine.state.value
        run.transcript_len = len(h.view._transcript)
        await j.flush(checkpoint=j.checkpoint(run, run.state))

    # -- checks ----------------------------------------------------------------------------------
    def offer(self) -> None:
        """Limit the tools offered to the model this turn to those the session may call."""
        perms = self.h.run_state.permissions
        if perms is None:
            return
        settings = self.h.view.settings
        names = settings.active_tools if settings.active_tools is not None else self.h.view.tools.names
        settings.active_tools = [n for n in names if perms.may_call(n)]

    def denied(self, call: ToolUseBlock) -> ToolResultMessage | None:
        """``None`` when ``call`` keeps to the session's permissions; else its denial (logged as
        ``permission_denied``)."""
        h = self.h
        perms = h.run_state.permissions
        if perms is None:
            return None
        denial = perms.check(call.name, call.input if isinstance(call.input, dict) else {})
        if denial is None:
            return None
        payload: dict[str, Any] = {"call_id": call.id, "tool": call.name, "permission": denial.permission,
                                   "rule": denial.rule, "detail": denial.detail}
        h.record("permission_denied", payload)
        return ToolResultMessage(call.id, denial.message(), is_error=True, name=call.name,
                                 metadata={"denied_by": "permissions", "permission": denial.permission})
