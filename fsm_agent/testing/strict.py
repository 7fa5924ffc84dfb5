"""A strict scripted server for the three wire protocols: answers from a script, and refuses (HTTP
400, in the protocol's error shape) every request whose history breaks that protocol's rules.

Real providers reject a history with an unpaired tool call; a lenient fake would hide the bug.
Point a provider at it (``create_provider("openai", ProviderConfig(base_url=server.base_url,
api_key="x", model="m"))``; ``"anthropic"`` and ``"openai-responses"`` likewise) and check
``server.rejected`` afterwards.

Rules checked on every request (the first broken one is named in the 400's message), as the real
APIs state them in their errors:

* Chat Completions (``POST /chat/completions``, :func:`wire_violation`): the conversation is not
  empty and does not end with an ``assistant`` message (no prefill); every ``assistant`` tool call
  is answered by exactly one ``tool`` message, and those answers come straight after it, before any
  other message (``system`` included); every ``tool`` message answers a call of the ``assistant``
  message just before its group; no tool-call id appears twice in the conversation.
* Anthropic Messages (``POST /messages``, :func:`anthropic_violation`): every ``tool_use`` is
  answered by a ``tool_result`` in the very next message, a ``user`` one, where the results come
  before any other block; every ``tool_result`` answers a ``tool_use`` of the message just before;
  ``tool_use`` ids are unique.
* Responses (``POST /responses``, :func:`responses_violation`): every ``function_call`` has a
  ``function_call_output`` after it, and every output a call before it (unless the request names a
  ``previous_response_id``, whose calls are on the server).

These are the rules fsm_agent's protocol modules keep for any history, by
:func:`fsm_agent.types.normalize_pairing` and a typed :class:`~fsm_agent.errors.InvalidHistoryError`
for a result of no call.

The script: a list of :class:`Reply`, chosen by the number of assistant turns in the request
(reply ``k`` answers the request that already holds ``k`` of them, the last reply repeats), so a
run that is killed, cancelled or resumed gets the same answer for the same conversation; or a
callable ``(messages) -> Reply`` (the request's ``messages``, or ``input`` for Responses). Streamed
Chat requests (``"stream": true``) get SSE, with the text split into ``pieces`` sent
``chunk_delay`` seconds apart; Anthropic and Responses requests are answered with the whole JSON
response, streamed or not (a client must read it as the complete response).

    server = StrictServer([calls(("call_1", "add", {"a": 1, "b": 2})), text("3")])
    base_url = await server.start()
    ...
    assert server.rejected == [] and server.accepted == 2
    await server.close()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from attrs import define, field, frozen

from ._loopback import serve_on_loopback

__all__ = ["Reply", "StrictServer", "anthropic_violation", "calls", "responses_violation", "text",
           "wire_violation"]


@frozen
class Reply:
    """One scripted answer."""

    text: str = ""
    tool_calls: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    """``(id, name, arguments)`` of each tool call."""
    delay: float = 0.0
    """Seconds before the response starts."""
    pieces: int = 1
    """Streamed: the text is sent in this many deltas."""
    chunk_delay: float = 0.0
    """Streamed: seconds between deltas."""


def text(value: str, **kw: Any) -> Reply:
    """A plain answer (finish reason ``stop``)."""
    return Reply(text=value, **kw)


def calls(*tool_calls: tuple[str, str, dict[str, Any]], **kw: Any) -> Reply:
    """An answer with tool calls (finish reason ``tool_calls``)."""
    return Reply(tool_calls=tuple(tool_calls), **kw)


def wire_violation(messages: Any) -> str | None:
    """The first Chat Completions rule ``messages`` breaks, in words, or ``None`` when it is valid."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty array"
    seen_ids: set[str] = set()
    open_ids: list[str] = []  # calls of the last assistant turn still waiting for their result
    answered: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in open_ids:
                return (f"messages[{i}]: a message with role 'tool' must be a response to a preceding message "
                        f"with 'tool_calls' (tool_call_id {cid!r} has no open call)")
            if cid in answered:
                return f"messages[{i}]: tool_call_id {cid!r} is answered twice"
            answered.add(cid)
            continue
        missing = [c for c in open_ids if c not in answered]
        if missing:
            return (f"messages[{i}]: an assistant message with 'tool_calls' must be followed by tool messages "
                    f"responding to each 'tool_call_id'; missing: {', '.join(missing)}")
        open_ids, answered = [], set()
        if role == "assistant":
            for tc in m.get("tool_calls") or ():
                cid = tc.get("id")
                if not cid:
                    return f"messages[{i}]: a tool call without an id"
                if cid in seen_ids:
                    return f"messages[{i}]: duplicate tool call id {cid!r}"
                seen_ids.add(cid)
                open_ids.append(cid)
        elif role not in ("system", "developer", "user"):
            return f"messages[{i}]: unknown role {role!r}"
    missing = [c for c in open_ids if c not in answered]
    if missing:
        return ("the conversation ends with an assistant message whose 'tool_calls' have no tool messages: "
                + ", ".join(missing))
    if messages[-1].get("role") == "assistant":
        return "the conversation must not end with an assistant message (prefill is not supported)"
    return None


def anthropic_violation(body: Any) -> str | None:
    """The first Anthropic Messages rule the request ``body`` breaks, in the API's words, or ``None``."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    seen: set[Any] = set()
    owed: list[Any] = []  # tool_use ids of the previous (assistant) message
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        missing = [c for c in owed if role != "user" or c not in results]
        if missing:
            return (f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                    "in the next message.")
        extra = [r for r in results if r not in owed]
        if extra:
            return (f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{', '.join(map(str, extra))}. Each `tool_result` block must have a corresponding `tool_use` "
                    "block in the previous message.")
        if results and any(b.get("type") != "tool_result" for b in blocks[:len(results)]):
            return f"messages.{i}.content: `tool_result` blocks must come first in the content of a user message"
        owed = []
        if role == "assistant":
            for b in blocks:
                if b.get("type") == "tool_use":
                    cid = b.get("id")
                    if cid in seen:
                        return f"messages.{i}.content: `tool_use` ids must be unique ({cid!r})"
                    seen.add(cid)
                    owed.append(cid)
    if owed:
        return (f"messages.{len(messages) - 1}: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {', '.join(owed)}")
    return None


def responses_violation(body: Any) -> str | None:
    """The first Responses rule the request ``body`` breaks, in the API's words, or ``None``."""
    items = body.get("input") if isinstance(body, dict) else None
    if isinstance(items, str):
        return None
    if not isinstance(items, list) or not items:
        return "input: a non-empty string or array is required"
    on_server = bool(body.get("previous_response_id"))
    calls: set[Any] = set()
    answered: set[Any] = set()
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        cid = item.get("call_id") if isinstance(item, dict) else None
        if kind == "function_call":
            calls.add(cid)
        elif kind == "function_call_output":
            if cid not in calls and not on_server:
                return f"No tool call found for function call output with call_id {cid}."
            answered.add(cid)
    missing = sorted(str(c) for c in calls - answered)
    if missing:
        return f"No tool output found for function call {missing[0]}."
    return None


@define
class StrictServer:
    """See the module docstring. ``requests`` holds every request body; ``rejected`` the
    ``(request index, reason)`` of every refusal; ``accepted`` counts answered requests."""

    script: Sequence[Reply] | Callable[[list[dict[str, Any]]], Reply]
    model: str = "m"
    base_url: str = ""
    requests: list[dict[str, Any]] = field(factory=list)
    rejected: list[tuple[int, str]] = field(factory=list)
    accepted: int = 0
    _runner: web.AppRunner | None = None

    def pick(self, messages: list[dict[str, Any]]) -> Reply:
        if callable(self.script):
            return self.script(messages)
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        return self.script[min(turns, len(self.script) - 1)]

    async def start(self) -> str:
        """Serve on 127.0.0.1 (a free port); returns the base URL."""
        app = web.Application()
        for prefix in ("", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._handle)
            app.router.add_post(f"{prefix}/messages", self._handle_anthropic)
            app.router.add_post(f"{prefix}/responses", self._handle_responses)
        self._runner, self.base_url = await serve_on_loopback(app)
        return self.base_url

    async def _read(self, request: web.Request) -> tuple[int, dict[str, Any]]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        self.requests.append(body if isinstance(body, dict) else {})
        return len(self.requests) - 1, body if isinstance(body, dict) else {}

    async def _handle_anthropic(self, request: web.Request) -> web.StreamResponse:
        index, body = await self._read(request)
        problem = anthropic_violation(body)
        if problem is not None:
            self.rejected.append((index, problem))
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": problem}}, status=400)
        self.accepted += 1
        messages = body["messages"]
        reply = self.pick(messages)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
        content += [{"type": "tool_use", "id": cid, "name": name, "input": args} for cid, name, args in reply.tool_calls]
        return web.json_response({"id": "msg_strict", "type": "message", "role": "assistant", "model": self.model,
                                  "content": content, "stop_reason": "tool_use" if reply.tool_calls else "end_turn",
                                  "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}})

    async def _handle_responses(self, request: web.Request) -> web.StreamResponse:
        index, body = await self._read(request)
        problem = responses_violation(body)
        if problem is not None:
            self.rejected.append((index, problem))
            return web.json_response({"error": {"message": problem, "type": "invalid_request_error",
                                                "param": "input", "code": None}}, status=400)
        self.accepted += 1
        items = body.get("input")
        items = items if isinstance(items, list) else [{"role": "user", "content": items}]
        turns, was_output = 0, False  # runs of output items (assistant message, call, reasoning): turns
        for it in items:
            out = isinstance(it, dict) and (it.get("role") == "assistant" or it.get("type") in ("function_call",
                                                                                             "reasoning"))
            turns += out and not was_output
            was_output = out
        reply = self.script(items) if callable(self.script) else self.script[min(turns, len(self.script) - 1)]
        if reply.delay:
            await asyncio.sleep(reply.delay)
        output: list[dict[str, Any]] = []
        if reply.text:
            output.append({"type": "message", "id": "msg_strict", "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": reply.text, "annotations": []}]})
        output += [{"type": "function_call", "id": f"fc_{k}", "call_id": cid, "name": name,
                    "arguments": orjson.dumps(args).decode(), "status": "completed"}
                   for k, (cid, name, args) in enumerate(reply.tool_calls)]
        return web.json_response({"id": "resp_strict", "object": "response", "status": "completed",
                                  "model": self.model, "output": output,
                                  "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}})

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        index = len(self.requests)
        self.requests.append(body if isinstance(body, dict) else {})
        messages = body.get("messages") if isinstance(body, dict) else None
        problem = wire_violation(messages)
        if problem is not None:
            self.rejected.append((index, problem))
            return web.json_response({"error": {"message": problem, "type": "invalid_request_error",
                                                "param": "messages", "code": None}}, status=400)
        self.accepted += 1
        reply = self.pick(messages)  # type: ignore[arg-type]
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if body.get("stream"):
            return await self._stream(request, reply)
        return web.json_response(self._completion(reply))

    def _completion(self, reply: Reply) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
        if reply.tool_calls:
            msg["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
                                 for cid, name, args in reply.tool_calls]
        return {"id": "chatcmpl-strict", "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": msg,
                             "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

    async def _stream(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = {"id": "chatcmpl-strict", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        try:
            await resp.write(chunk({"role": "assistant", "content": ""}))
            if reply.text:
                n = max(1, reply.pieces)
                size = max(1, -(-len(reply.text) // n))
                for k in range(0, len(reply.text), size):
                    if k and reply.chunk_delay:
                        await asyncio.sleep(reply.chunk_delay)
                    await resp.write(chunk({"content": reply.text[k:k + size]}))
            for i, (cid, name, args) in enumerate(reply.tool_calls):
                await resp.write(chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                                        "function": {"name": name,
                                                                     "arguments": orjson.dumps(args).decode()}}]}))
            await resp.write(chunk({}, "tool_calls" if reply.tool_calls else "stop"))
            usage = {"id": "chatcmpl-strict", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                     "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
            await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client cut the stream
            pass
        return resp
