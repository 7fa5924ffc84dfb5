"""Sandboxes for model-written code (CodeAct): run Python under real OS isolation.

See :mod:`fsm_agent.sandbox.base` for the :class:`Sandbox` protocol.
"""
