"""The world of ``control_vs_model.py``: a small support desk (orders, tickets, e-mails, refunds), its
tools, the fixed task set, the scripted model that works the tasks, and the checks.

Nothing here knows which mode runs it. Three parties read the same facts in three ways:

* the **scripted model** (:func:`scripted_reply`) reads only the conversation it is sent, as a
  model would: the task, the tool results, and feedback;
* the **acceptance check** (:func:`acceptance`, what the runtime's verifier is given) reads only
  the run's transcript: the answer must quote values from successful tool results;
* the **outcome check** (:meth:`Task.outcome`, the bench's judge) reads the world: which side
  effects happened, how often, with which arguments, and whether the answer states the facts.

Side effects are counted where they happen: every execution that commits an effect is recorded
under the effect's key (a ticket's title, an e-mail's recipient and subject, a refund's order),
so a second execution for the same key is a duplicate whatever call, attempt or resume made it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from attrs import define, field, frozen

from fsm_agent import Tool, ToolEffect
from fsm_agent.testing.strict import Reply, calls, text

# -- the desk's fixed data ----------------------------------------------------------------------------------
ORDERS: dict[str, dict[str, Any]] = {
    "ORD-1001": {"order_id": "ORD-1001", "status": "shipped", "customer_email": "ann@example.com", "total": 40.0},
    "ORD-1002": {"order_id": "ORD-1002", "status": "delayed", "customer_email": "bob@example.com", "total": 18.5},
    "ORD-1003": {"order_id": "ORD-1003", "status": "delivered", "customer_email": "cy@example.com", "total": 129.9},
    "ORD-1004": {"order_id": "ORD-1004", "status": "delayed", "customer_email": "dee@example.com", "total": 64.0},
}
RATES = {("EUR", "USD"): 1.09, ("USD", "EUR"): 0.92, ("GBP", "USD"): 1.27}
PRICES = {"SKU-7": 12.5, "SKU-9": 3.2}
KB = [{"article_id": "KB-42", "title": "How to reset your password"},
      {"article_id": "KB-17", "title": "Shipping times"}]

PURE_LATENCY = 0.12
"""Seconds a read-only tool takes (the desk's API round trip)."""
EFFECT_LATENCY = 0.4
"""Seconds a side-effecting tool takes; the effect commits half-way, so a cut in the second half
leaves an effect whose result never came back."""


EFFECT_TOOLS = frozenset({"create_ticket", "send_email", "issue_refund"})
"""The tools with side effects."""


@define
class Execution:
    """One execution of a tool body."""

    tool: str
    args: dict[str, Any]
    started: float
    key: str | None = None
    """The effect's key, for a side-effecting tool that committed; ``None`` otherwise."""
    outcome: str = "running"
    """``ok``, ``error``, ``cancelled`` (cut by a timeout or an interrupt) or ``running``."""


@define
class World:
    """One run's desk: what exists, what was done, and the hooks the fault injector sets.

    ``on_tool_start(index, tool)`` is called at the start of every tool execution (1-based index over
    the run, across attempts and resumes); it returns ``"hang"`` to make this execution hang until it
    is cancelled, or a delay in seconds after which ``interrupt()`` is to be called, or ``None``.
    """

    on_tool_start: Callable[[int, str], Any] = lambda index, tool: None
    interrupt: Callable[[], None] = lambda: None
    tickets: list[dict[str, Any]] = field(factory=list)
    emails: list[dict[str, Any]] = field(factory=list)
    refunds: list[dict[str, Any]] = field(factory=list)
    executions: list[Execution] = field(factory=list)

    # -- effects ---------------------------------------------------------------------------------
    def effects(self) -> dict[str, int]:
        """Committed side effects by key: how many times each happened."""
        out: dict[str, int] = {}
        for e in self.executions:
            if e.key is not None:
                out[e.key] = out.get(e.key, 0) + 1
        return out

    def duplicates(self) -> int:
        """Extra executions of side effects: for each key, every commit after the first."""
        return sum(n - 1 for n in self.effects().values())

    # -- the tool bodies ---------------------------------------------------------------------------
    async def _enter(self, tool: str, args: dict[str, Any]) -> Execution:
        ex = Execution(tool, dict(args), time.monotonic())
        self.executions.append(ex)
        what = self.on_tool_start(len(self.executions), tool)
        if what == "hang":
            try:
                await asyncio.Event().wait()  # a hung connection: only a cancel ends it
            finally:
                ex.outcome = "cancelled"
        if isinstance(what, (int, float)):
            asyncio.get_running_loop().call_later(float(what), self.interrupt)
        return ex

    async def _pure(self, tool: str, args: dict[str, Any], body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        ex = await self._enter(tool, args)
        try:
            await asyncio.sleep(PURE_LATENCY)
            value = body()
        except asyncio.CancelledError:
            ex.outcome = "cancelled"
            raise
        except Exception:
            ex.outcome = "error"
            raise
        ex.outcome = "ok"
        return value

    async def _effect(self, tool: str, args: dict[str, Any], key: str,
                      commit: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        ex = await self._enter(tool, args)
        try:
            await asyncio.sleep(EFFECT_LATENCY / 2)
            value = commit()
            ex.key = key
            await asyncio.sleep(EFFECT_LATENCY / 2)  # the effect is done; the answer is on its way back
        except asyncio.CancelledError:
            ex.outcome = "cancelled"
            raise
        ex.outcome = "ok"
        return value

    def tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        """This world's tools (fresh objects: each run has its own); ``names``: only these."""
        world = self

        async def lookup_order(order_id: str) -> dict[str, Any]:
            """Look up an order: its status, the customer's e-mail address and the total (USD).

            Args:
                order_id: the order id, e.g. "ORD-1001".
            """
            def body() -> dict[str, Any]:
                order = ORDERS.get(order_id.strip().upper()) or ORDERS.get("ORD-" + order_id.strip())
                if order is None:
                    raise LookupError(f"no order {order_id!r}")
                return dict(order)
            return await world._pure("lookup_order", {"order_id": order_id}, body)

        async def get_rate(base: str, quote: str) -> dict[str, Any]:
            """The exchange rate from one currency to another.

            Args:
                base: the currency converted from, e.g. "EUR".
                quote: the currency converted to, e.g. "USD".
            """
            def body() -> dict[str, Any]:
                rate = RATES.get((base.upper(), quote.upper()))
                if rate is None:
                    raise LookupError(f"no rate for {base}/{quote}")
                return {"base": base.upper(), "quote": quote.upper(), "rate": rate}
            return await world._pure("get_rate", {"base": base, "quote": quote}, body)

        async def get_price(sku: str) -> dict[str, Any]:
            """The unit price of a product (USD, before tax).

            Args:
                sku: the product's SKU, e.g. "SKU-7".
            """
            def body() -> dict[str, Any]:
                price = PRICES.get(sku.strip().upper())
                if price is None:
                    raise LookupError(f"no product {sku!r}")
                return {"sku": sku.strip().upper(), "unit_price": price}
            return await world._pure("get_price", {"sku": sku}, body)

        async def calculate(expression: str) -> dict[str, Any]:
            """Evaluate an arithmetic expression (+ - * / and parentheses).

            Args:
                expression: e.g. "250 * 1.09".
            """
            def body() -> dict[str, Any]:
                if not re.fullmatch(r"[0-9.+\-*/() ]{1,200}", expression):
                    raise ValueError(f"not an arithmetic expression: {expression!r}")
                return {"expression": expression, "value": round(float(eval(expression, {"__builtins__": {}})), 2)}
            return await world._pure("calculate", {"expression": expression}, body)

        async def search_kb(query: str) -> dict[str, Any]:
            """Search the knowledge base; returns the best matching article.

            Args:
                query: words to look for, e.g. "password reset".
            """
            def body() -> dict[str, Any]:
                words = set(re.findall(r"[a-z]+", query.lower()))
                best = max(KB, key=lambda a: len(words & set(re.findall(r"[a-z]+", a["title"].lower()))))
                return dict(best)
            return await world._pure("search_kb", {"query": query}, body)

        async def create_ticket(title: str, priority: str) -> dict[str, Any]:
            """Open a support ticket; returns its id.

            Args:
                title: the ticket's title.
                priority: "low", "normal" or "high".
            """
            def commit() -> dict[str, Any]:
                ticket = {"ticket_id": f"T-{100 + len(world.tickets) + 1}", "title": title, "priority": priority}
                world.tickets.append(ticket)
                return dict(ticket)
            return await world._effect("create_ticket", {"title": title, "priority": priority},
                                       "ticket:" + _norm(title), commit)

        async def send_email(to: str, subject: str, body: str) -> dict[str, Any]:
            """Send an e-mail to a customer; returns the message id.

            Args:
                to: the recipient's address.
                subject: the subject line.
                body: the message text.
            """
            def commit() -> dict[str, Any]:
                mail = {"message_id": f"M-{500 + len(world.emails) + 1}", "to": to, "subject": subject, "body": body}
                world.emails.append(mail)
                return {"message_id": mail["message_id"], "to": to, "subject": subject}
            return await world._effect("send_email", {"to": to, "subject": subject, "body": body},
                                       f"email:{_norm(to)}:{_norm(subject)}", commit)

        async def issue_refund(order_id: str, amount: float) -> dict[str, Any]:
            """Refund an order (USD); returns the refund id.

            Args:
                order_id: the order id, e.g. "ORD-1003".
                amount: the amount to refund, in USD.
            """
            def commit() -> dict[str, Any]:
                refund = {"refund_id": f"R-{700 + len(world.refunds) + 1}", "order_id": order_id, "amount": amount}
                world.refunds.append(refund)
                return dict(refund)
            return await world._effect("issue_refund", {"order_id": order_id, "amount": amount},
                                       "refund:" + _norm(order_id), commit)

        async def find_tickets(title: str) -> dict[str, Any]:
            """Find open tickets whose title matches (to check whether one exists already).

            Args:
                title: the title to look for.
            """
            return await world._pure("find_tickets", {"title": title}, lambda: {
                "tickets": [dict(t) for t in world.tickets if _norm(t["title"]) == _norm(title)]})

        async def find_emails(to: str, subject: str) -> dict[str, Any]:
            """Find e-mails already sent to an address with a subject (to check whether one was sent).

            Args:
                to: the recipient's address.
                subject: the subject line.
            """
            return await world._pure("find_emails", {"to": to, "subject": subject}, lambda: {
                "emails": [{"message_id": m["message_id"], "to": m["to"], "subject": m["subject"]}
                           for m in world.emails if _norm(m["to"]) == _norm(to) and _norm(m["subject"]) == _norm(subject)]})

        async def find_refunds(order_id: str) -> dict[str, Any]:
            """Find refunds already issued for an order (to check whether one was issued).

            Args:
                order_id: the order id.
            """
            return await world._pure("find_refunds", {"order_id": order_id}, lambda: {
                "refunds": [dict(r) for r in world.refunds if _norm(r["order_id"]) == _norm(order_id)]})

        side = ToolEffect.SIDE_EFFECT
        every = [Tool(lookup_order), Tool(get_rate), Tool(get_price), Tool(calculate), Tool(search_kb),
                 Tool(create_ticket, effect=side), Tool(send_email, effect=side), Tool(issue_refund, effect=side),
                 Tool(find_tickets), Tool(find_emails), Tool(find_refunds)]
        return [t for t in every if names is None or t.name in names]


def _norm(s: Any) -> str:
    return " ".join(str(s).lower().split())


# -- the tasks ------------------------------------------------------------------------------------------------
Results = dict[str, dict[str, Any]]
"""A step's label → its (successful) tool result, parsed."""


@frozen
class Step:
    """One tool call the task needs. ``args`` builds the arguments from the results so far."""

    label: str
    tool: str
    args: Callable[[Results], dict[str, Any]]
    quote: str
    """The result field that proves the step done (what a node's answer must quote)."""
    check: tuple[str, Callable[[Results], dict[str, Any]], str] | None = None
    """For a side effect: (the tool that finds it, its arguments, the result list's key): what a
    careful model calls when it does not know whether the effect happened."""

    @property
    def tools(self) -> tuple[str, ...]:
        """Tools whose successful result proves this step: its own, and its check tool."""
        return (self.tool,) if self.check is None else (self.tool, self.check[0])


@frozen
class Task:
    """One task of the fixed set."""

    name: str
    prompt: str
    steps: tuple[tuple[Step, ...], ...]
    """Turns of tool calls, in order; the calls of one turn are made together."""
    answer: Callable[[Results], str]
    effects: Callable[[World], dict[str, dict[str, Any]]]
    """The effects the task must leave, by key, with the arguments they must have had."""
    facts: Callable[[World], list[str]]
    """What the answer must state, read from the world (e.g. the id of the ticket that exists)."""
    grounded: tuple[tuple[tuple[str, ...], str], ...]
    """The acceptance check: (tools whose successful result may carry it, field) pairs whose value
    the answer must quote."""
    self_retry: bool
    """How the scripted model takes a failed tool call: ``True`` calls it again at once, ``False``
    reports the failure as its answer (and tries again only when told to)."""

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The tools offered for this task: those its steps use, and their check tools."""
        return tuple(dict.fromkeys(name for turn in self.steps for st in turn for name in st.tools))

    @property
    def model_calls(self) -> int:
        """Model calls of a fault-free run (one per tool turn, then the answer)."""
        return len(self.steps) + 1

    @property
    def tool_calls(self) -> int:
        """Tool executions of a fault-free run."""
        return sum(len(s) for s in self.steps)

    def outcome(self, world: World, answer: str | None) -> dict[str, Any]:
        """The judge: ``correct`` when the answer states the facts, every intended effect happened
        exactly once with the intended arguments, and nothing else happened."""
        want = self.effects(world)
        got = world.effects()
        missing = [k for k in want if k not in got]
        unwanted = [k for k in got if k not in want]
        wrong_args = [k for k, attrs in want.items() if k in got and not _args_match(world, k, attrs)]
        facts = self.facts(world)
        text_ok = answer is not None and all(f.lower() in answer.lower() for f in facts)
        dup = world.duplicates()
        return {"correct": bool(text_ok and not missing and not unwanted and not wrong_args and dup == 0),
                "answer_ok": text_ok, "missing_effects": missing, "unwanted_effects": unwanted,
                "wrong_args": wrong_args, "duplicates": dup, "facts": facts}


def _args_match(world: World, key: str, attrs: dict[str, Any]) -> bool:
    for e in world.executions:
        if e.key == key and all(_norm(e.args.get(a)) == _norm(v) if not isinstance(v, float)
                                else abs(float(e.args.get(a) or 0) - v) < 0.01 for a, v in attrs.items()):
            return True
    return False


def _ticket_ids(world: World, title: str) -> list[str]:
    return [t["ticket_id"] for t in world.tickets if _norm(t["title"]) == _norm(title)][:1] or ["<no ticket>"]


def _mail_ids(world: World, to: str) -> list[str]:
    return [m["message_id"] for m in world.emails if _norm(m["to"]) == _norm(to)][:1] or ["<no e-mail>"]


def _refund_ids(world: World, order: str) -> list[str]:
    return [r["refund_id"] for r in world.refunds if _norm(r["order_id"]) == _norm(order)][:1] or ["<no refund>"]


PRINTER = "Printer on floor 3 is jammed"
KB_TITLE = "Review KB-42 (password reset)"
DELAY_TITLE = "Order ORD-1004 is delayed"
DELAY_SUBJECT_2 = "Your order ORD-1002 is delayed"
DELAY_SUBJECT_4 = "Your order ORD-1004 is delayed"


def _check_ticket(title: str) -> tuple[str, Callable[[Results], dict[str, Any]], str]:
    return ("find_tickets", lambda r: {"title": title}, "tickets")


TASKS: tuple[Task, ...] = (
    Task("order_status", "What is the status of order ORD-1001?",
         ((Step("order", "lookup_order", lambda r: {"order_id": "ORD-1001"}, "status"),),),
         lambda r: f"Order ORD-1001 is {r['order']['status']}.",
         lambda w: {}, lambda w: ["shipped"], ((("lookup_order",), "status"),), self_retry=True),
    Task("convert", "How much is 250 EUR in USD?",
         ((Step("rate", "get_rate", lambda r: {"base": "EUR", "quote": "USD"}, "rate"),),
          (Step("sum", "calculate", lambda r: {"expression": f"250 * {r['rate']['rate']}"}, "value"),)),
         lambda r: f"250 EUR is {r['sum']['value']:.2f} USD (rate {r['rate']['rate']}).",
         lambda w: {}, lambda w: ["272.50"], ((("calculate",), "value"),), self_retry=False),
    Task("open_ticket", f"Open a high-priority ticket titled '{PRINTER}' and tell me its id.",
         ((Step("ticket", "create_ticket", lambda r: {"title": PRINTER, "priority": "high"}, "ticket_id", _check_ticket(PRINTER)),),),
         lambda r: f"Opened ticket {r['ticket']['ticket_id']}.",
         lambda w: {"ticket:" + _norm(PRINTER): {"priority": "high"}}, lambda w: _ticket_ids(w, PRINTER),
         ((("create_ticket", "find_tickets"), "ticket_id"),), self_retry=True),
    Task("delay_email", "Tell the customer of order ORD-1002 by e-mail that their parcel is delayed.",
         ((Step("order", "lookup_order", lambda r: {"order_id": "ORD-1002"}, "status"),),
          (Step("mail", "send_email", lambda r: {"to": r["order"]["customer_email"], "subject": DELAY_SUBJECT_2,
                                                 "body": "We are sorry: your parcel is delayed."}, "message_id",
                ("find_emails", lambda r: {"to": r["order"]["customer_email"], "subject": DELAY_SUBJECT_2}, "emails")),)),
         lambda r: f"E-mailed {r['mail']['to']} (message {r['mail']['message_id']}).",
         lambda w: {f"email:bob@example.com:{_norm(DELAY_SUBJECT_2)}": {"to": "bob@example.com"}},
         lambda w: _mail_ids(w, "bob@example.com"), ((("send_email", "find_emails"), "message_id"),), self_retry=False),
    Task("refund", "Refund order ORD-1003 in full.",
         ((Step("order", "lookup_order", lambda r: {"order_id": "ORD-1003"}, "status"),),
          (Step("refund", "issue_refund", lambda r: {"order_id": "ORD-1003", "amount": r["order"]["total"]}, "refund_id",
                ("find_refunds", lambda r: {"order_id": "ORD-1003"}, "refunds")),)),
         lambda r: f"Refunded {r['refund']['amount']:.2f} USD for ORD-1003 (refund {r['refund']['refund_id']}).",
         lambda w: {"refund:ord-1003": {"amount": 129.9}}, lambda w: _refund_ids(w, "ORD-1003"),
         ((("issue_refund", "find_refunds"), "refund_id"),), self_retry=True),
    Task("kb_ticket", "Find our knowledge-base article about password resets and open a normal-priority ticket "
                      "to review it, titled 'Review <article id> (password reset)'.",
         ((Step("kb", "search_kb", lambda r: {"query": "password reset"}, "article_id"),),
          (Step("ticket", "create_ticket", lambda r: {"title": f"Review {r['kb']['article_id']} (password reset)",
                                                      "priority": "normal"}, "ticket_id", _check_ticket(KB_TITLE)),)),
         lambda r: f"Opened ticket {r['ticket']['ticket_id']} to review {r['kb']['article_id']}.",
         lambda w: {"ticket:" + _norm(KB_TITLE): {"priority": "normal"}}, lambda w: _ticket_ids(w, KB_TITLE),
         ((("create_ticket", "find_tickets"), "ticket_id"),), self_retry=False),
    Task("price_tax", "What do 3 units of SKU-7 cost including 8% tax?",
         ((Step("price", "get_price", lambda r: {"sku": "SKU-7"}, "unit_price"),),
          (Step("sum", "calculate", lambda r: {"expression": f"3 * {r['price']['unit_price']} * 1.08"}, "value"),)),
         lambda r: f"3 units of SKU-7 cost {r['sum']['value']:.2f} USD including tax.",
         lambda w: {}, lambda w: ["40.50"], ((("calculate",), "value"),), self_retry=True),
    Task("delayed_order", "Check order ORD-1004. If it is delayed, open a high-priority ticket titled "
                          f"'{DELAY_TITLE}' and e-mail the customer.",
         ((Step("order", "lookup_order", lambda r: {"order_id": "ORD-1004"}, "status"),),
          (Step("ticket", "create_ticket", lambda r: {"title": DELAY_TITLE, "priority": "high"}, "ticket_id", _check_ticket(DELAY_TITLE)),
           Step("mail", "send_email", lambda r: {"to": r["order"]["customer_email"], "subject": DELAY_SUBJECT_4,
                                                 "body": "We are sorry: your parcel is delayed."}, "message_id",
                ("find_emails", lambda r: {"to": r["order"]["customer_email"], "subject": DELAY_SUBJECT_4}, "emails")))),
         lambda r: (f"ORD-1004 is delayed: opened ticket {r['ticket']['ticket_id']} and e-mailed "
                    f"{r['mail']['to']} (message {r['mail']['message_id']})."),
         lambda w: {"ticket:" + _norm(DELAY_TITLE): {"priority": "high"},
                    f"email:dee@example.com:{_norm(DELAY_SUBJECT_4)}": {"to": "dee@example.com"}},
         lambda w: _ticket_ids(w, DELAY_TITLE) + _mail_ids(w, "dee@example.com"),
         ((("create_ticket", "find_tickets"), "ticket_id"), (("send_email", "find_emails"), "message_id")),
         self_retry=False),
)
BY_PROMPT = {t.prompt: t for t in TASKS}

SYSTEM_PROMPT = ("You are a support agent with tools for orders, tickets, e-mails and refunds. Use the tools to "
                 "do the task, then answer in one sentence that quotes the ids and values the tools returned.")


# -- the scripted model -----------------------------------------------------------------------------------------
FEEDBACK_MARKERS = ("did not pass verification", "did not pass its check")
"""Words of a feedback message (the verifier's, a plan node's check): the scripted model treats a user
message holding one of them, after a failed call, as being told to try again."""


def _content(m: dict[str, Any]) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c or ""


def classify(result: str) -> tuple[str, Any]:
    """(status, parsed) of a tool result as the model reads it: ``ok`` (a JSON object), ``unknown``
    (the call was cut while running: it may have taken effect), ``not_run``, ``timeout`` or ``error``."""
    try:
        value = orjson.loads(result)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and "error" not in value:
        return "ok", value
    low = result.lower()
    if "outcome is unknown" in low or "may or may not have taken effect" in low:
        return "unknown", None
    if "did not run" in low:
        return "not_run", None
    if "timed out" in low:
        return "timeout", None
    return "error", None


def scripted_reply(messages: list[dict[str, Any]]) -> Reply:
    """The scripted model: the next reply to ``messages`` (OpenAI Chat wire messages).

    It works the task named by the first user message step by step, reading results back from the
    ``tool`` messages. Its one judgement call, a failed tool call, follows the task's ``self_retry``;
    a call it saw cut while running (``unknown``), or a side effect that timed out, it first looks
    up with the step's check tool, as a careful model would, and redoes only when nothing is found.

    Under a plan (the PlanAct plugin's note "Current step sK" in the system message) it works only
    the steps of node ``sK`` and answers with their results; it answers the planner and the
    replanner (recognised by their system prompts) with the task's plan.
    """
    system = _content(messages[0]) if messages and messages[0].get("role") == "system" else ""
    if system.startswith(("Split the TASK", "A step of the plan")):
        return _plan_reply(system, _content(messages[-1]))
    task = next((BY_PROMPT.get(_content(m)) for m in messages if m.get("role") == "user"), None)
    if task is None:
        return text("I cannot help with that.", **_PACE)
    node = re.search(r"Current step s(\d+):", system)
    upto = int(node.group(1)) if node else None
    n = sum(1 for m in messages if m.get("role") == "assistant")
    attempts: dict[str, list[tuple[int, str, Any]]] = {}  # label -> [(message index, status, value)]
    labels: dict[str, str] = {}
    feedback_at: list[int] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            for tc in m.get("tool_calls") or ():
                labels[tc.get("id", "")] = tc.get("id", "").rsplit("-", 1)[0]
        elif role == "tool":
            label = labels.get(m.get("tool_call_id", ""), "")
            attempts.setdefault(label, []).append((i, *classify(_content(m))))
        elif role == "user" and any(k in _content(m).lower() for k in FEEDBACK_MARKERS):
            feedback_at.append(i)

    results: Results = {}
    for turn in task.steps[:upto]:
        todo: list[tuple[str, str, dict[str, Any]]] = []
        for step in turn:
            tries = attempts.get(step.label, [])
            if not tries:
                todo.append((step.label, step.tool, step.args(results)))
                continue
            at, status, value = tries[-1]
            if status == "ok":
                results[step.label] = value
                continue
            if status == "not_run":
                todo.append((step.label, step.tool, step.args(results)))
                continue
            if step.check is not None and status in ("unknown", "timeout"):
                checks = [c for c in attempts.get("check_" + step.label, []) if c[0] > at]
                if not checks:
                    tool, args, _ = step.check
                    todo.append(("check_" + step.label, tool, args(results)))
                    continue
                _, cstatus, cvalue = checks[-1]
                found = (cvalue or {}).get(step.check[2]) if cstatus == "ok" else None
                if found:
                    results[step.label] = found[0]
                    continue
            told = any(f > at for f in feedback_at)
            if task.self_retry or told:
                todo.append((step.label, step.tool, step.args(results)))
                continue
            return text(f"I could not finish: the {step.tool} call failed ({status}).", **_PACE)
        if todo:
            return calls(*((f"{label}-{n}", tool, args) for label, tool, args in todo),
                         text=f"Next: {', '.join(t for _, t, _ in todo)}.", **_PACE)
    if upto is not None and upto <= len(task.steps):
        done = task.steps[upto - 1]
        return text("Done: " + "; ".join(f"{st.label} {_quoted(results[st.label][st.quote])}" for st in done) + ".",
                    **_PACE)
    return text(task.answer(results), **_PACE)


def _quoted(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def task_plan(task: Task) -> list[dict[str, Any]]:
    """The plan the scripted planner writes for ``task``: a node per turn of tool calls (checked by
    the check named after its first step), then a node that answers (checked by the task's rule)."""
    nodes: list[dict[str, Any]] = []
    for k, turn in enumerate(task.steps, 1):
        nodes.append({"id": f"s{k}", "goal": "Call " + " and ".join(st.tool for st in turn) + " for the task",
                      "depends_on": [f"s{k - 1}"] if k > 1 else [],
                      "acceptance": "The result gives the " + " and the ".join(st.quote for st in turn),
                      "check": "_".join(st.label for st in turn)})
    k = len(task.steps) + 1
    nodes.append({"id": f"s{k}", "goal": "Answer the user", "depends_on": [f"s{k - 1}"],
                  "acceptance": "The answer quotes the ids and values the tools returned", "check": None})
    return nodes


def _plan_reply(system: str, body: str) -> Reply:
    """The scripted planner (or replanner): the task's plan, less the nodes the request lists as done."""
    goal = body.split("\n", 1)[0].removeprefix("TASK: ").strip()
    task = BY_PROMPT.get(goal)
    if task is None:
        return text('{"nodes": [{"id": "s1", "goal": "Answer", "depends_on": [], "acceptance": "an answer", '
                    '"check": null}]}', **_PACE)
    nodes = task_plan(task)
    if system.startswith("A step of the plan"):
        section, done = "", set()
        for line in body.splitlines():
            if line.endswith(":") or line.startswith(("DONE", "FAILED", "NOT STARTED")):
                section = line.split(":")[0]
            elif section == "DONE" and line.startswith("- "):
                done.add(line[2:].split(":", 1)[0])
        nodes = [nd for nd in nodes if nd["id"] not in done]
    return text(orjson.dumps({"nodes": nodes}).decode(), **_PACE)


_PACE = {"delay": 0.03, "pieces": 4, "chunk_delay": 0.02}
"""Every scripted reply: 30 ms to the first byte, then its text in 4 deltas 20 ms apart (so a stream
can be cut, or interrupted, in the middle)."""


# -- the acceptance checks (what the runtime's verifier is given) -----------------------------------------------
Requirement = tuple[tuple[str, ...], str]
"""(tools whose successful result may carry it, field): the answer must quote that field's value."""


def grounded_problems(requirements: Sequence[Requirement], results: Sequence[tuple[str, str, bool]],
                      answer: str) -> list[str]:
    """Why ``answer`` is not backed by the run's successful tool results, or ``[]``.

    ``results``: ``(tool name, result text, is_error)`` in transcript order. These checks read the
    transcript only, never the world: they are what a developer can give the runtime.
    """
    problems = []
    for tools, fieldname in requirements:
        values: list[str] = []
        for name, content, is_error in results:
            if name not in tools or is_error:
                continue
            status, value = classify(content)
            if status != "ok":
                continue
            for item in [value, *[x for v in value.values() if isinstance(v, list) for x in v if isinstance(x, dict)]]:
                if fieldname in item:
                    values.append(_quoted(item[fieldname]))
        if not values:
            problems.append(f"no successful {' or '.join(tools)} result gives the {fieldname}")
        elif not any(v.lower() in answer.lower() for v in values):
            problems.append(f"the answer does not quote the {fieldname} ({', '.join(values)}) that "
                            f"{' or '.join(tools)} returned")
    return problems


def node_checks(task: Task) -> dict[str, tuple[Requirement, ...]]:
    """The plan's named checks for ``task``: one per turn of tool calls, named after its steps' labels."""
    return {"_".join(st.label for st in turn): tuple((st.tools, st.quote) for st in turn) for turn in task.steps}
