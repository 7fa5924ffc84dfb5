"""Orchestration patterns built on the Agent: several agents with real boundaries (each its own
session, budget, contract and stop reason), and foreign tools (MCP) and agents (A2A).

Multi-agent patterns (``docs/multi-agent.md``): :mod:`.subagent` (``agent_tool``: an agent called as
a tool), :mod:`.handoff` (``Handoffs``: a handoff with a recovery package), :mod:`.team` (``Team``:
a leader and N workers under a merge rule), :mod:`.result` (``PatternResult``: what the handoff
chain and the team return), and :mod:`.links` (parent/child session links, used by every pattern and
by the A2A client)."""
