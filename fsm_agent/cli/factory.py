"""What a command runs on, built from its flags and the environment: the session store and the agent.

The agent's settings (:func:`settings_of`) are a plain dict, stored with the session
(``metadata["cli"]``) so that ``resume`` builds the same agent again with :class:`AgentFactory`:
the provider (or the embedded local model, started here), the demo tools, the default plugins,
a policy file, ``--approve-tools``, command hooks (``--hooks``, ``--hook``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import os
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigurationError
from ..plugins import DEFAULT_MIDDLEWARE

__all__ = ["AGENT_FLAGS", "AgentFactory", "checked_store", "default_settings", "env", "local_model", "open_store", "settings_of"]


def env(*names: str) -> str | None:
    """The first of these environment variables that is set and not empty, else ``None``."""
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


# -- the session store ------------------------------------------------------------------------
def open_store(location: str | None = None, *, create: bool = True) -> Any:
    """The session store at ``location`` / ``$FSM_AGENT_STORE`` / ``~/.fsm-agent/sessions.db``.

    Raises:
        ConfigurationError: ``create`` is false and no SQLite store exists there (a mistyped path).
    """
    from ..store.postgres import PostgresStore
    from ..store.sqlite import SQLiteStore

    loc = location or env("FSM_AGENT_STORE") or str(Path(env("FSM_AGENT_HOME") or "~/.fsm-agent").expanduser()
                                                     / "sessions.db")
    if loc.startswith(("postgres://", "postgresql://")):
        return PostgresStore(loc)
    if not create and not Path(loc).is_file():
        raise ConfigurationError(f"no session store at {loc} (no run has been stored there yet); "
                                 "check --store or $FSM_AGENT_STORE")
    return SQLiteStore(loc)


async def checked_store(location: str | None = None, *, create: bool = True) -> Any:
    """:func:`open_store`, then one read, so that a store that cannot be opened (an unreachable
    server, a path that cannot be created, a file that is no database) is found before anything
    starts and before a session id is printed.

    Raises:
        ConfigurationError: the store cannot be opened; the message names its location and why.
    """
    from ..errors import StoreError

    try:
        store = open_store(location, create=create)
    except StoreError as exc:
        raise ConfigurationError(_store_problem(exc)) from None
    try:
        await store.list_sessions(1)  # connects, creates or migrates the schema
    except StoreError as exc:
        with contextlib.suppress(Exception):
            await store.close()
        raise ConfigurationError(_store_problem(exc)) from None
    return store


def _store_problem(exc: Any) -> str:
    again = "; retrying may help" if exc.transient else ""
    return (f"cannot open the session store {exc.location}: {exc.cause}{again} "
            "(check --store or $FSM_AGENT_STORE)")


# -- the agent --------------------------------------------------------------------------------
AGENT_FLAGS = ("provider", "base_url", "model", "api_key", "local_model", "tool", "tool_mode", "system", "middleware",
               "no_default_middleware", "policy", "approve_tools", "hooks", "hook")
"""The ``args`` attributes of the flags that build the agent (``run``'s and ``serve``'s,
:func:`fsm_agent.cli.parser.agent_flags`)."""


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The agent settings of ``fsm-agent run``'s flags (and ``$FSM_AGENT_*``); stored with the session.

    Raises:
        ConfigurationError: a bad ``--local-model`` (see :func:`local_model`), or ``--model`` with no
            provider (the embedded model would run under another model's name).
    """
    provider = args.provider or env("FSM_AGENT_PROVIDER")
    base_url = args.base_url or env("FSM_AGENT_BASE_URL")
    if provider is None and base_url:
        provider = "openai-compatible"
    if (provider or "local") == "local" and args.model:
        # the embedded server runs its GGUF file whatever the request names: running it under the
        # name of another model would answer with the wrong model and exit 0
        raise ConfigurationError(
            f"--model {args.model} names a provider's model, but no provider is configured: the embedded local "
            "model (SmolLM2-135M) would run instead. Give its provider (--provider openai|anthropic|deepseek|qwen|"
            "..., with its API key) or --base-url URL of an OpenAI-compatible server; to run a GGUF file on the "
            "embedded server, give --local-model PATH.gguf instead of --model")
    return {
        "provider": provider or "local",
        "base_url": base_url,
        "model": args.model or env("FSM_AGENT_MODEL"),
        "tool_mode": args.tool_mode,
        "tools": list(args.tool),
        "system": args.system,
        "middleware": list(args.middleware),
        "default_middleware": not args.no_default_middleware,
        "policy": str(Path(args.policy).resolve()) if args.policy else None,
        "approve_tools": list(args.approve_tools),
        "hooks": str(Path(args.hooks).resolve()) if args.hooks else None,
        "hook": list(args.hook),
        "local_model": local_model(args.local_model, provider or "local"),
    }


def default_settings() -> dict[str, Any]:
    """The settings of ``fsm-agent run`` with no flags and no environment: the embedded local
    model with the default plugins (what ``fsm-agent serve`` serves without ``--agent``)."""
    return {"provider": "local", "base_url": None, "model": None, "tool_mode": None, "tools": [], "system": None,
            "middleware": [], "default_middleware": True, "policy": None, "approve_tools": [],
            "hooks": None, "hook": [], "local_model": local_model(None, "local")}


def local_model(path: str | None, provider: str, session_id: str | None = None) -> str | None:
    """``--local-model PATH`` checked before anything starts: the absolute path of a GGUF file.

    ``session_id``: the session a ``resume`` continues (its provider cannot change).

    Raises:
        ConfigurationError: the file is missing or not GGUF, or another provider was chosen.
    """
    if path is None:
        return None
    if provider != "local":
        if session_id is not None:
            raise ConfigurationError(f"--local-model runs a GGUF file on the embedded llama.cpp server; session "
                                     f"{session_id} runs on the provider {provider!r}, which a resume keeps "
                                     "(leave out --local-model)")
        raise ConfigurationError(f"--local-model runs a GGUF file on the embedded llama.cpp server; it does not "
                                 f"combine with the provider {provider!r} (leave out --provider/--base-url)")
    from ..local import check_gguf

    return check_gguf(path, "--local-model")


class AgentFactory:
    """Builds the agent of a run (or a resumed run) from CLI settings; owns the local server.

    Construction loads the tools and plugins (a bad name fails here, before any server starts);
    ``async with`` starts the embedded local model when the provider is ``local`` and opens the
    provider; leaving closes both.

    Raises:
        ConfigurationError: an unknown tool or plugin, a bad policy or hooks file or ``--hook``, an
            ``--approve-tools`` pattern that matches no enabled tool.
    """

    def __init__(self, settings: dict[str, Any], api_key: str | None, err: TextIO) -> None:
        self.s, self.api_key, self.err = settings, api_key, err
        self.server: Any = None
        self.provider: Any = None
        self.tools, self.middleware = self._plugins()  # bad names fail here, before any server starts

    def _plugins(self) -> tuple[list[Any], list[Any]]:
        from ..plugins import discover, load_plugin
        from ..tools.demo import DEMO_TOOLS

        tools = []
        for name in self.s["tools"]:
            if name not in DEMO_TOOLS:
                raise ConfigurationError(f"unknown tool {name!r}; demo tools: {', '.join(DEMO_TOOLS)}")
            tools.append(DEMO_TOOLS[name])
        names: list[str] = []
        if self.s["default_middleware"]:
            installed = {p.name for p in discover()}
            names += [n for n in DEFAULT_MIDDLEWARE if n in installed]
        names += [n for n in self.s["middleware"] if n not in names]
        middleware = [load_plugin(n)() for n in names]
        if self.s.get("policy"):
            middleware.insert(0, load_plugin("tool_policy").from_file(self.s["policy"]))  # type: ignore[attr-defined]
        approve = self.s.get("approve_tools") or []  # absent in sessions stored before the option existed
        for pattern in approve:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in self.s["tools"]):
                enabled = ", ".join(self.s["tools"]) or "none; enable one with --tool NAME"
                raise ConfigurationError(f"--approve-tools {pattern!r}: no enabled tool matches it (enabled: {enabled})")
        if approve:
            middleware.append(load_plugin("approval")(tools=approve))  # type: ignore[call-arg]
        if self.s.get("hooks") or self.s.get("hook"):  # absent in sessions stored before the options existed
            hooks: Any = load_plugin("command_hooks")
            middleware.append(hooks.from_cli(self.s.get("hooks"), self.s.get("hook") or []))
        return tools, middleware

    async def __aenter__(self) -> AgentFactory:
        from ..local import MODEL_FILE as SMOLLM2_FILE
        from ..local import TOOL_MODEL_HINT, LocalLlamaServer
        from ..providers.base import ProviderConfig, ToolMode
        from ..providers.profiles import create_provider

        s = self.s
        name, base_url = s["provider"], s["base_url"]
        if name == "local":
            # settings made before --local-model existed have no "local_model"
            self.server = LocalLlamaServer(s.get("local_model"),
                                           log=lambda m: None if self.err.write(f"fsm-agent: {m}\n") else None)
            model = Path(self.server.model_path).name
            which = "SmolLM2-135M" if model == SMOLLM2_FILE else model
            self.err.write(f"fsm-agent: no provider configured; using the embedded local model ({which} via "
                           "llama.cpp)\n")
            if s["model"]:  # $FSM_AGENT_MODEL (the flag is refused by settings_of)
                self.err.write(f"fsm-agent: note: the model name {s['model']!r} ($FSM_AGENT_MODEL) is not used: it "
                               f"names a provider's model, and no provider is configured; {which} runs\n")
            if self.tools and model == SMOLLM2_FILE:
                self.err.write(f"fsm-agent: note: SmolLM2-135M cannot use tools reliably; for --tool give "
                               f"--local-model PATH.gguf with {TOOL_MODEL_HINT}\n")
            await asyncio.to_thread(self.server.start)
            name, base_url = "llamacpp", self.server.base_url
        self.provider = create_provider(name, ProviderConfig(
            model=s["model"], base_url=base_url, api_key=self.api_key or env("FSM_AGENT_API_KEY"),
            tool_mode=ToolMode(s["tool_mode"]) if s["tool_mode"] else None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.provider is not None:
            await self.provider.aclose()
        if self.server is not None:
            self.server.stop()

    def agent(self, store: Any, config: Any, observers: list[Any]) -> Any:
        """The :class:`~fsm_agent.Agent` on this factory's provider, tools and plugins (inside ``async with``)."""
        from ..agent import Agent

        return Agent(self.provider, tools=self.tools, system_prompt=self.s["system"], middleware=self.middleware,
                     observers=observers, config=config, store=store)
