"""The agents a worker serves, by name, and the providers each can reach.

A session's workflow names its agent; the workflow code and the activities, on any worker, look
it up here. Every worker builds the same agent from the same code (``module:attr``), so the same
name means the same tools, plugins and providers everywhere. A provider travels between the
workflow and an activity as a key (:func:`provider_key`), resolved on the activity's worker among
the providers its agent can reach: the agent's own, the middleware's (a grader's, a planner's,
fallbacks), and any registered with :func:`register` ``providers=``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..providers.base import Provider

if TYPE_CHECKING:
    from ..agent import Agent

__all__ = ["agent_named", "child_agents", "name_of", "provider_key", "provider_named", "register", "registered"]

_AGENTS: dict[str, Agent] = {}
_PROVIDERS: dict[str, dict[str, Provider]] = {}


def register(name: str, agent: Agent, *, providers: Iterable[Provider] = ()) -> None:
    """Serve ``agent`` under ``name`` in this process (what ``fsm-agent worker --agent`` does), and
    the agents its tools run as child sessions (:func:`child_agents`) under derived names
    (``name/tool``, ``name/tool/1`` for a tool's second agent, and so on down), so that a child
    session can run as a workflow of its own on every worker built from the same code.

    Raises:
        ConfigurationError: another agent is registered under ``name``.
    """
    held = _AGENTS.get(name)
    if held is not None and held is not agent:
        raise ConfigurationError(f"another agent is registered as {name!r} in this process")
    _AGENTS[name] = agent
    _NAMES.setdefault(id(agent), name)
    found = {provider_key(p): p for p in (agent.provider, *providers, *_reachable(agent))}
    _PROVIDERS[name] = found
    if held is None:
        for child_name, child in child_agents(name, agent):
            if child_name not in _AGENTS and id(child) not in _NAMES:
                register(child_name, child)


_NAMES: dict[int, str] = {}
"""The name each registered agent (by identity) was first registered under."""


def name_of(agent: Agent) -> str | None:
    """The name ``agent`` (this very object) is served under in this process, or ``None``."""
    name = _NAMES.get(id(agent))
    return name if name is not None and _AGENTS.get(name) is agent else None


def child_agents(name: str, agent: Agent) -> list[tuple[str, Agent]]:
    """The agents ``agent``'s tools hold (an agent tool's sub-agent, a Team's workers, a handoff's
    agents: the agents the tool's function closes over or keeps as attributes, lists and dicts
    included, and those of an object it closes over, one level down), with their derived names: ``name/tool``
    for a tool's first agent, ``name/tool/i`` for its ``i``-th after that, in the order the tool
    holds them (the same on every worker built from the same code)."""
    from ..agent import Agent as _Agent

    def items(value: Any) -> tuple[Any, ...]:
        if isinstance(value, (list, tuple)):
            return tuple(value)
        if isinstance(value, dict):
            return tuple(value.values())
        return (value,)

    out: list[tuple[str, Agent]] = []
    for tool in agent.tools:
        found: list[Agent] = []

        def take(v: Any) -> bool:
            if isinstance(v, _Agent):
                if v is not agent and all(v is not f for f in found):
                    found.append(v)
                return True
            return False

        fn = getattr(tool, "fn", None)
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
        for value in (*cells, *_attributes(tool)):
            for v in items(value):
                if not take(v) and not callable(v):
                    # an object the tool's function closes over (a Team, a Handoffs chain): its agents
                    for inner in _attributes(v):
                        for w in items(inner):
                            take(w)
        out += [(f"{name}/{tool.name}" + (f"/{i}" if i else ""), a) for i, a in enumerate(found)]
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def registered() -> dict[str, Agent]:
    """The agents this process serves, by name."""
    return dict(_AGENTS)


def agent_named(name: str) -> Agent:
    """The agent registered as ``name``.

    Raises:
        ConfigurationError: none is (a worker without this agent picked the session up).
    """
    agent = _AGENTS.get(name)
    if agent is None:
        known = ", ".join(sorted(_AGENTS)) or "none"
        raise ConfigurationError(f"no agent {name!r} is served by this worker (it serves: {known}); start the "
                                 "worker with the same --agent as the process that started the session")
    return agent


def provider_key(provider: Provider) -> str:
    """What names ``provider`` between a workflow and an activity: its class, name, model and URL."""
    return ":".join(str(x) for x in (type(provider).__name__, getattr(provider, "name", ""),
                                      getattr(provider, "model", ""), getattr(provider, "base_url", "")))


def provider_named(agent_name: str, key: str) -> Provider:
    """The provider ``key`` names among those agent ``agent_name`` reaches.

    Raises:
        ConfigurationError: none matches (a provider a plugin makes at run time, say): register it
            with :func:`register` ``providers=``.
    """
    agent = agent_named(agent_name)
    found = _PROVIDERS.get(agent_name) or {}
    p = found.get(key)
    if p is None:
        found.update({provider_key(x): x for x in _reachable(agent)})
        p = found.get(key)
    if p is None:
        raise ConfigurationError(f"provider {key!r} is not reachable from agent {agent_name!r} on this worker; pass "
                                 "it to fsm_agent.temporal.register(..., providers=[...])")
    return p


def _reachable(agent: Agent) -> list[Provider]:
    """The providers an agent's middleware and tools hold (one attribute level, lists included)."""
    out: list[Provider] = []
    for holder in (*agent.middleware, *agent.tools):
        for value in _attributes(holder):
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, Provider):
                    out.append(v)
    return out


def _attributes(obj: Any) -> list[Any]:
    values: list[Any] = []
    try:
        values.extend(vars(obj).values())
    except TypeError:
        pass
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            values.append(getattr(obj, name))
    return values
