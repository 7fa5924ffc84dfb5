"""Orchestration patterns built on the Agent: several agents with real boundaries (each its own
session, budget, contract and stop reason), and foreign tools (MCP) and agents (A2A)."""
