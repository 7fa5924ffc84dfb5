"""Built-in middleware plugins for fsm_agent.

Each module is one plugin, registered under the entry-point group
``fsm_agent.middleware`` (see ``setup.cfg``) and importing only the public
``fsm_agent`` API. Nothing in ``fsm_agent`` imports this package; the runtime
finds plugins through their entry points.
"""
