"""fsm_agent: governed LLM agents as an explicit finite-state machine.

The loop phases (PreTurn → Model → MidTurn → PostTurn) and the seven ways a
run ends are states of a ``transitions`` machine; ordered middleware chains
enforce policy at each phase; observers watch; an aiohttp client layer speaks
to the providers.
"""

from ._version import __version__
from .agent import Agent
from .chain import MiddlewareChain
from .conditions import CONDITION_OPERATORS, ArgumentCondition, parse_condition
from .control import Cancel, Decision, Followup, Interrupt, LoopControl, RequestPermissions, Restrict, Steer
from .errors import (
    ChainError,
    ConfigurationError,
    ContextLengthExceededError,
    FsmAgentError,
    InvalidPlanError,
    LoopStop,
    MiddlewareError,
    PermissionsError,
    ProviderError,
    ResumeError,
    RunError,
    SessionBusyError,
    SessionConflictError,
    SessionEndedError,
    SessionExistsError,
    StopRun,
    StoreError,
    StructuredOutputError,
    SuspendCall,
    TaskDefinitionError,
    ToolArgumentsError,
    ToolError,
    UserError,
    WaitForHuman,
)
from .hooks import HookBus, Observer
from .config import RunConfig
from .loops import LoopConfig
from .context import RunContext
from .machine import TRANSITIONS, Phase, Trigger
from .middleware import (
    Allow,
    AskApproval,
    Complete,
    Continue,
    Deny,
    Edit,
    FailurePolicy,
    Middleware,
    ModelCallNext,
    Ordering,
    Respond,
    ToolCallNext,
    ToolDecision,
    TurnDecision,
)
from .providers import (
    Profile,
    Provider,
    ProviderCapabilities,
    ProviderConfig,
    ProviderType,
    RetryPolicy,
    ScriptedProvider,
    ToolMode,
    create_provider,
)
from .permissions import PermissionDenial, PermissionRequest, Permissions, Restriction, Scope
from .plugins import default_middleware
from .prompt import PromptFile, PromptSnapshot
from .store import MemoryStore, SQLiteStore, Store
from .structured import OutputStream, StructuredResult, parse_output, structured_call
from .task import AcceptanceCheck, CheckResult, Task, TaskAnswer, TaskBudget, TaskOutcome, TaskResult
from .tools import RUN_AGAIN, Tool, ToolContext, ToolEffect, ToolRegistry, tool
from .types import (
    AssistantMessage,
    BudgetWarning,
    Message,
    MessageRequest,
    MessageResponse,
    ModelRetry,
    ModelStopReason,
    ModelStreamEvent,
    NodeStatus,
    OutputPartial,
    OutputSchema,
    PendingAction,
    Plan,
    PlanNode,
    PlanUpdated,
    PolicyDecision,
    RunResult,
    RunStop,
    StopReason,
    SystemMessage,
    SystemPromptChanged,
    TextBlock,
    ThinkingBlock,
    ToolFinished,
    ToolProgress,
    ToolResultMessage,
    ToolStarted,
    ToolUseBlock,
    TransitionEvent,
    Usage,
    UsageRolledUp,
    UserMessage,
)

__all__ = [
    "AcceptanceCheck",
    "Agent",
    "Allow",
    "ArgumentCondition",
    "AskApproval",
    "AssistantMessage",
    "BudgetWarning",
    "CONDITION_OPERATORS",
    "Cancel",
    "ChainError",
    "CheckResult",
    "Complete",
    "ConfigurationError",
    "ContextLengthExceededError",
    "Continue",
    "Decision",
    "Deny",
    "Edit",
    "FailurePolicy",
    "Followup",
    "FsmAgentError",
    "HookBus",
    "Interrupt",
    "InvalidPlanError",
    "LoopConfig",
    "LoopControl",
    "LoopStop",
    "MemoryStore",
    "Message",
    "MessageRequest",
    "MessageResponse",
    "Middleware",
    "MiddlewareChain",
    "MiddlewareError",
    "ModelCallNext",
    "ModelRetry",
    "ModelStopReason",
    "ModelStreamEvent",
    "NodeStatus",
    "Observer",
    "Ordering",
    "OutputPartial",
    "OutputSchema",
    "OutputStream",
    "PendingAction",
    "PermissionDenial",
    "PermissionRequest",
    "Permissions",
    "PermissionsError",
    "Phase",
    "Plan",
    "PlanNode",
    "PlanUpdated",
    "PolicyDecision",
    "PostgresStore",
    "Profile",
    "PromptFile",
    "PromptSnapshot",
    "Provider",
    "ProviderCapabilities",
    "ProviderConfig",
    "ProviderError",
    "ProviderType",
    "RUN_AGAIN",
    "RequestPermissions",
    "Respond",
    "Restrict",
    "Restriction",
    "ResumeError",
    "RetryPolicy",
    "RunConfig",
    "RunContext",
    "RunError",
    "RunResult",
    "RunStop",
    "SQLiteStore",
    "Scope",
    "ScriptedProvider",
    "SessionBusyError",
    "SessionConflictError",
    "SessionEndedError",
    "SessionExistsError",
    "Steer",
    "StopReason",
    "StopRun",
    "Store",
    "StoreError",
    "StructuredOutputError",
    "StructuredResult",
    "SuspendCall",
    "SystemMessage",
    "SystemPromptChanged",
    "TRANSITIONS",
    "Task",
    "TaskAnswer",
    "TaskBudget",
    "TaskDefinitionError",
    "TaskOutcome",
    "TaskResult",
    "TextBlock",
    "ThinkingBlock",
    "Tool",
    "ToolArgumentsError",
    "ToolCallNext",
    "ToolContext",
    "ToolDecision",
    "ToolEffect",
    "ToolError",
    "ToolFinished",
    "ToolMode",
    "ToolProgress",
    "ToolRegistry",
    "ToolResultMessage",
    "ToolStarted",
    "ToolUseBlock",
    "TransitionEvent",
    "Trigger",
    "TurnDecision",
    "Usage",
    "UsageRolledUp",
    "UserError",
    "UserMessage",
    "WaitForHuman",
    "__version__",
    "create_provider",
    "default_middleware",
    "instrument",
    "parse_condition",
    "parse_output",
    "structured_call",
    "tool",
]


def instrument(settings: object = None, **options: object) -> object:
    """Turn on OpenTelemetry GenAI traces and metrics for every :class:`Agent` run in this process
    (an agent's own ``Agent(instrument=...)`` wins). Needs the extra ``fsm-agent[otel]``; nothing of
    OpenTelemetry is imported until this is called. See :func:`fsm_agent.otel.instrument` for the
    arguments; returns the :class:`fsm_agent.otel.Instrumentation` now in force.

    Raises:
        ConfigurationError: the ``otel`` extra is not installed, or a bad setting.
    """
    from .otel import instrument as _instrument

    return _instrument(settings, **options)  # type: ignore[arg-type]


def __getattr__(name: str) -> object:
    if name == "PostgresStore":  # asyncpg is optional: imported only when asked for
        from .store.postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module 'fsm_agent' has no attribute {name!r}")
