"""fsm_agent: governed LLM agents as an explicit finite-state machine.

The loop phases (PreTurn → Model → MidTurn → PostTurn) and the seven ways a
run ends are states of a ``transitions`` machine; ordered middleware chains
enforce policy at each phase; observers watch; an aiohttp client layer speaks
to the providers.
"""

from ._version import __version__
from .agent import Agent
from .chain import MiddlewareChain
from .control import Cancel, Decision, Followup, Interrupt, LoopControl, Steer
from .errors import (
    ChainError,
    ConfigurationError,
    ContextLengthExceededError,
    FsmAgentError,
    MiddlewareError,
    ProviderError,
    ResumeError,
    RunError,
    SessionConflictError,
    SessionExistsError,
    StopRun,
    StoreError,
    StructuredOutputError,
    ToolArgumentsError,
    UserError,
)
from .hooks import HookBus, Observer
from .machine import TRANSITIONS, Phase, RunConfig, RunContext, Trigger
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
from .plugins import default_middleware
from .store import MemoryStore, SQLiteStore, Store
from .structured import StructuredResult, parse_output, structured_call
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
    OutputSchema,
    PendingAction,
    RunResult,
    RunStop,
    StopReason,
    SystemMessage,
    TextBlock,
    ThinkingBlock,
    ToolFinished,
    ToolResultMessage,
    ToolStarted,
    ToolUseBlock,
    TransitionEvent,
    Usage,
    UserMessage,
)

__all__ = [
    "Agent",
    "Allow",
    "AskApproval",
    "AssistantMessage",
    "BudgetWarning",
    "Cancel",
    "ChainError",
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
    "LoopControl",
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
    "Observer",
    "Ordering",
    "OutputSchema",
    "PendingAction",
    "Phase",
    "PostgresStore",
    "Profile",
    "Provider",
    "ProviderCapabilities",
    "ProviderConfig",
    "ProviderError",
    "ProviderType",
    "RUN_AGAIN",
    "Respond",
    "ResumeError",
    "RetryPolicy",
    "RunConfig",
    "RunContext",
    "RunError",
    "RunResult",
    "RunStop",
    "SQLiteStore",
    "ScriptedProvider",
    "SessionConflictError",
    "SessionExistsError",
    "Steer",
    "StopReason",
    "StopRun",
    "Store",
    "StoreError",
    "StructuredOutputError",
    "StructuredResult",
    "SystemMessage",
    "TRANSITIONS",
    "TextBlock",
    "ThinkingBlock",
    "Tool",
    "ToolArgumentsError",
    "ToolCallNext",
    "ToolContext",
    "ToolDecision",
    "ToolEffect",
    "ToolFinished",
    "ToolMode",
    "ToolRegistry",
    "ToolResultMessage",
    "ToolStarted",
    "ToolUseBlock",
    "TransitionEvent",
    "Trigger",
    "TurnDecision",
    "Usage",
    "UserError",
    "UserMessage",
    "__version__",
    "create_provider",
    "default_middleware",
    "parse_output",
    "structured_call",
    "tool",
]


def __getattr__(name: str) -> object:
    if name == "PostgresStore":  # asyncpg is optional: imported only when asked for
        from .store.postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module 'fsm_agent' has no attribute {name!r}")
