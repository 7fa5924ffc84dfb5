"""Durable execution on Temporal: a session is a workflow, its model calls and tools are activities.

The extra ``fsm-agent[temporal]`` (on ``temporalio``). The pieces:

* :class:`TemporalHost` — give it to an :class:`~fsm_agent.Agent` (``Agent(..., host=...)``): ``run``,
  ``resume``, ``decide``, ``control`` go to the session's workflow;
* :func:`create_worker` / :func:`register` — a worker that drives the sessions of the agents it
  serves (``fsm-agent worker --temporal HOST:PORT --agent module:attr``);
* :class:`SessionWorkflow`, :class:`WorkflowPort`, the activities — the mapping itself
  (``docs/temporal.md``).
"""

from .host import DEFAULT_TASK_QUEUE, TemporalHost
from .port import Timeouts, WorkflowPort
from .registry import register
from .worker import create_worker, sandbox_runner
from .workflow import SessionWorkflow

__all__ = ["DEFAULT_TASK_QUEUE", "SessionWorkflow", "TemporalHost", "Timeouts", "WorkflowPort", "create_worker",
           "register", "sandbox_runner"]
