"""``python -m fsm_agent.cli ARGS``: the ``fsm-agent`` command."""

from . import console

if __name__ == "__main__":  # pragma: no cover
    console()
