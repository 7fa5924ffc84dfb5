"""``python -m fsm_agent.cli ARGS``: the ``fsm-agent`` command."""

import sys

from . import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
