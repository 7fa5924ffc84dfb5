"""What a run of a multi-agent pattern returns: the part every pattern's result shares
(:class:`PatternResult`), which :class:`~fsm_agent.orchestration.handoff.HandoffResult` and
:class:`~fsm_agent.orchestration.team.TeamResult` extend with their own record of the children."""

from __future__ import annotations

from typing import Any, TypeVar

from attrs import frozen

from ..types.messages import Usage
from ..types.run import RunResult, RunStop

__all__ = ["PatternResult"]

_R = TypeVar("_R", bound="PatternResult")


@frozen
class PatternResult:
    """How a run of a pattern that several agents work in (a handoff chain, a team) ended, seen from
    its top session: the first agent's session of a chain, the leader's session of a team."""

    session_id: str
    """The top session: the pattern's handle (resume it, send it controls)."""
    stop: RunStop
    """The pattern's stop: the top session's."""
    output: str
    """The pattern's answer (a chain's: its last agent's; a team's: the leader's merged answer)."""
    output_data: Any
    """The structured answer, with the answer, when its agent had an output schema; else ``None``."""
    usage: Usage
    """Tokens of every session of the pattern (each child's rolled up into the top session)."""
    cost_usd: float | None
    """USD of every session of the pattern; ``None`` when a price was unknown."""
    result: RunResult
    """The top session's own :class:`~fsm_agent.types.RunResult`."""

    @classmethod
    def from_run(cls: type[_R], top: RunResult, *, answer: RunResult | None = None, **children: Any) -> _R:
        """The result of a pattern whose top session ended with ``top``: its session, stop, usage and
        cost; the answer (``output``, ``output_data``) is ``answer``'s when given (a chain's last
        agent), else ``top``'s. ``children``: the subclass's own fields (``chain=``, ``workers=``)."""
        said = top if answer is None else answer
        return cls(session_id=top.session_id, stop=top.stop, output=said.output, output_data=said.output_data,
                   usage=top.usage, cost_usd=top.cost_usd, result=top, **children)
