"""The message repair pipeline (seed 000 §5.2.4): each pass on its own with exact values, the cases
B01, B02, B04 (and the B20 tighter re-trim), and MessageRepair inside real runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsm_agent import Agent, ContextLengthExceededError, Middleware, RunConfig, ScriptedProvider, StopReason, tool
from fsm_agent.providers import ProviderCapabilities, ProviderConfig, create_provider
from fsm_agent.types import (
    AssistantMessage,
    Message,
    MessageRequest,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)
from fsm_agent.types.tokens import count_message_tokens, estimate_request_tokens
from fsm_agent_middleware.repair import (
    RULES,
    MessageRepair,
    drop_empty_content,
    normalize_system_messages,
    normalize_tool_call_ids,
    pair_tool_calls_with_results,
    repair_message_order,
    repair_messages,
    rules_for,
    synthesize_missing_results,
    trim_to_context_window,
    truncate_old_tool_results,
)

from corpus import CASES, case_messages
ANTHROPIC, OPENAI, GENERIC = RULES["anthropic"], RULES["openai-chat"], RULES["generic"]


def load(name: str) -> Any:
    return json.loads((CASES / name).read_text())




def roles(messages: list[Message]) -> list[str]:
    return [m.role for m in messages]


def call(i: str, name: str = "f", **args: Any) -> ToolUseBlock:
    return ToolUseBlock(i, name, args)


def asst(*calls: ToolUseBlock, text: str = "") -> AssistantMessage:
    return AssistantMessage(((TextBlock(text),) if text else ()) + calls)


def res(i: str, text: str = "ok") -> ToolResultMessage:
    return ToolResultMessage(i, text)


def non_system(ms: list[Message]) -> int:
    """B01's stand-in for a token count: one per non-system message."""
    return sum(1 for m in ms if not isinstance(m, SystemMessage))


def no_orphans(ms: list[Message]) -> bool:
    seen: set[str] = set()
    for m in ms:
        if isinstance(m, AssistantMessage):
            seen.update(c.id for c in m.tool_calls)
        elif isinstance(m, ToolResultMessage) and m.tool_call_id not in seen:
            return False
    return True


# -- pass 0: drop_empty_content (B04) -------------------------------------------------------
def test_drop_empty_content_removes_blank_blocks_and_turns() -> None:
    c = call("t1")
    ms = [SystemMessage("  "), UserMessage("hi"), AssistantMessage((TextBlock(""), c)), res("t1"),
          AssistantMessage(" \n"), UserMessage((TextBlock("a"), TextBlock("\t"))), res("t2", "")]
    assert drop_empty_content(ms) == [UserMessage("hi"), AssistantMessage((c,)), res("t1"),
                                      UserMessage("a"), res("t2", "")]


def test_drop_empty_content_keeps_untouched_messages_identical() -> None:
    ms = [UserMessage("hi"), asst(call("x"), text="Let me see.")]
    out = drop_empty_content(ms)
    assert out == ms and all(a is b for a, b in zip(out, ms, strict=True)) and out is not ms


# -- pass 1: trim_to_context_window (B01) ---------------------------------------------------
def test_b01_trim_removes_whole_groups_and_starts_on_a_user_message() -> None:
    case, want = load("B01.json"), load("B01.expected.json")
    ms = case_messages(case["messages"])
    budget = case["trim_budget"]["max_non_system_messages"]
    naive = [ms[0], *ms[-budget:]]
    assert roles(naive) == want["naive_keep_last_5_would_give_roles"]  # the bug this case is about
    out = trim_to_context_window(ms, budget, count=non_system)
    assert roles(out) == want["repaired_roles"]
    assert [m.text for m in out if m.role == "user"] == want["repaired_user_texts"]
    assert out[0] == SystemMessage("You are a concise travel assistant.")
    assert no_orphans(out)
    assert out == [ms[0], ms[5], ms[6], ms[7]]


def test_trim_never_splits_a_group() -> None:
    ms = [UserMessage("q"), asst(call("a"), call("b")), res("a"), res("b"), UserMessage("next")]
    # room for 3: the group does not fit after "next"; room for 4: it fits but would lead the list, so it
    # goes whole either way (never the call without its results, never results without their call)
    assert trim_to_context_window(ms, 3, count=non_system) == [UserMessage("next")]
    assert trim_to_context_window(ms, 4, count=non_system) == [UserMessage("next")]
    assert trim_to_context_window(ms, 5, count=non_system) == ms


def test_trim_keeps_the_task_of_a_long_tool_run() -> None:
    ms = [SystemMessage("s"), UserMessage("task"), asst(call("1")), res("1"), asst(call("2")), res("2"),
          asst(call("3")), res("3")]
    out = trim_to_context_window(ms, 5, count=non_system)
    assert out == [SystemMessage("s"), UserMessage("task"), asst(call("2")), res("2"), asst(call("3")), res("3")]
    out = trim_to_context_window(ms, 4, count=non_system)
    assert out == [SystemMessage("s"), UserMessage("task"), asst(call("3")), res("3")]
    out = trim_to_context_window(ms, 2, count=non_system)  # over budget rather than without the task
    assert out == [SystemMessage("s"), UserMessage("task"), asst(call("3")), res("3")]


def test_trim_with_real_token_counts_keeps_the_largest_suffix_that_fits() -> None:
    ms = [SystemMessage("be brief"), UserMessage("first question " * 20), AssistantMessage("first answer " * 20),
          UserMessage("second question"), AssistantMessage("second answer"), UserMessage("third question")]
    fits = [ms[0], *ms[3:]]
    exact = count_message_tokens(fits)
    assert trim_to_context_window(ms, exact) == fits
    assert trim_to_context_window(ms, exact - 1) == [ms[0], ms[5]]
    assert trim_to_context_window(ms, count_message_tokens(ms)) == ms
    assert trim_to_context_window(ms, None) == ms


def test_trim_drops_results_left_without_their_call() -> None:
    ms = [res("gone"), UserMessage("q"), AssistantMessage("a"), UserMessage("q2")]
    assert trim_to_context_window(ms, 3, count=non_system) == [UserMessage("q"), AssistantMessage("a"),
                                                               UserMessage("q2")]


# -- pass 2: normalize_system_messages ------------------------------------------------------
def test_system_messages_are_merged_first_in_order() -> None:
    ms = [UserMessage("u"), SystemMessage("A"), AssistantMessage("x"), SystemMessage(""), SystemMessage("B")]
    assert normalize_system_messages(ms) == [SystemMessage("A\n\nB"), UserMessage("u"), AssistantMessage("x")]


def test_one_system_message_is_moved_first_or_left_alone() -> None:
    s = SystemMessage("S")
    assert normalize_system_messages([UserMessage("u"), s]) == [s, UserMessage("u")]
    out = normalize_system_messages([s, UserMessage("u")])
    assert out[0] is s
    assert normalize_system_messages([UserMessage("u")]) == [UserMessage("u")]
    assert normalize_system_messages([SystemMessage(" "), SystemMessage(""), UserMessage("u")]) == [UserMessage("u")]


# -- pass 3: repair_message_order -----------------------------------------------------------
def test_results_move_up_past_a_user_message_in_call_order() -> None:
    a = asst(call("c1"), call("c2"))
    ms = [UserMessage("go"), a, UserMessage("are you there?"), res("c2", "two"), res("c1", "one")]
    assert repair_message_order(ms, OPENAI) == [UserMessage("go"), a, res("c1", "one"), res("c2", "two"),
                                                UserMessage("are you there?")]


def test_results_move_up_past_an_assistant_message() -> None:
    a = asst(call("c1"))
    ms = [UserMessage("go"), a, AssistantMessage("thinking aloud"), res("c1")]
    assert repair_message_order(ms, ANTHROPIC) == [UserMessage("go"), a, res("c1"), AssistantMessage("thinking aloud")]


def test_ids_reused_every_turn_stay_with_their_own_turn() -> None:
    a1, a2 = asst(call("call_0", x=1)), asst(call("call_0", x=2))
    ms = [UserMessage("go"), a1, res("call_0", "r1"), a2, UserMessage("hm"), res("call_0", "r2")]
    assert repair_message_order(ms, OPENAI) == [UserMessage("go"), a1, res("call_0", "r1"), a2,
                                                res("call_0", "r2"), UserMessage("hm")]


def test_first_turn_must_be_user_for_anthropic_but_not_openai() -> None:
    ms = [SystemMessage("s"), AssistantMessage("Ahoy! How may I help?"), UserMessage("hi")]
    assert repair_message_order(ms, ANTHROPIC) == [SystemMessage("s"), UserMessage("hi")]
    assert repair_message_order(ms, GENERIC) == [SystemMessage("s"), UserMessage("hi")]
    assert repair_message_order(ms, OPENAI) == ms
    only_assistant = [AssistantMessage("x")]
    assert repair_message_order(only_assistant, ANTHROPIC) == only_assistant  # never emptied


def test_order_leaves_orphans_in_place() -> None:
    ms = [res("nobody"), UserMessage("u")]
    assert repair_message_order(ms, OPENAI) == ms


# -- pass 4: pair_tool_calls_with_results ---------------------------------------------------
def test_orphans_and_duplicates_are_dropped() -> None:
    a = asst(call("c1"))
    ms = [res("c1", "before its call"), UserMessage("u"), a, res("c1", "first"), res("c1", "again"),
          res("zzz", "no such call")]
    assert pair_tool_calls_with_results(ms) == [UserMessage("u"), a, res("c1", "first")]


def test_same_id_in_two_turns_is_two_calls() -> None:
    a1, a2 = asst(call("call_0")), asst(call("call_0"))
    ms = [UserMessage("u"), a1, res("call_0", "1"), a2, res("call_0", "2")]
    assert pair_tool_calls_with_results(ms) == ms


def test_same_id_twice_in_one_turn_takes_two_results() -> None:
    a = asst(call(""), call(""))
    ms = [UserMessage("u"), a, res("", "1"), res("", "2"), res("", "3")]
    assert pair_tool_calls_with_results(ms) == ms[:4]


# -- pass 5: synthesize_missing_results (B02) -----------------------------------------------
def test_b02_filtered_history_gets_an_unavailable_result() -> None:
    case = load("B02.json")["cases"][0]
    want = load("B02.expected.json")[case["name"]]
    ms = case_messages(case["messages"])
    out = synthesize_missing_results(ms)
    assert roles(out) == want["repaired_roles"]
    (syn,) = [m for m in out if isinstance(m, ToolResultMessage)]
    assert syn.tool_call_id == want["synthesized"][0]["tool_call_id"] == "toolu_PH_01"
    assert syn.is_error is want["synthesized"][0]["is_error"] is True
    assert want["synthesized"][0]["content_mentions"] in syn.text
    assert syn.text.startswith("[result unavailable] The result of lookup_invoice (toolu_PH_01)")
    assert syn.metadata == {"synthetic": "unavailable"} and syn.name == "lookup_invoice"
    assert out[2] == ms[2] and out[2].text == "Let me look that up."
    assert out[3] is syn and out[4:] == ms[3:]


def test_b02_interrupted_parallel_call_gets_a_cancelled_result_in_call_order() -> None:
    case = load("B02.json")["cases"][1]
    want = load("B02.expected.json")[case["name"]]
    ms = case_messages(case["messages"])
    out = synthesize_missing_results(ms)
    assert roles(out) == want["repaired_roles"]
    assert [m.tool_call_id for m in out if isinstance(m, ToolResultMessage)] == ["toolu_PH_10", "toolu_PH_11"]
    real, syn = out[2], out[3]
    assert real is ms[2] and not real.is_error
    assert syn.is_error and syn.metadata == {"synthetic": "cancelled"}
    assert want["synthesized"][0]["content_mentions"] in syn.text
    assert syn.text.startswith("[cancelled] The call ping_host (toolu_PH_11) was cancelled")


def test_synthesized_results_sit_between_the_real_ones() -> None:
    a = asst(call("a"), call("b"), call("c"))
    out = synthesize_missing_results([UserMessage("u"), a, res("c", "C"), res("a", "A")])
    assert [(m.tool_call_id, m.metadata) for m in out[2:]] == [("a", None), ("b", {"synthetic": "cancelled"}),
                                                               ("c", None)]


def test_a_call_at_the_end_was_interrupted() -> None:
    out = synthesize_missing_results([UserMessage("u"), asst(call("a"))])
    assert out[-1].metadata == {"synthetic": "cancelled"}


def test_complete_histories_are_unchanged() -> None:
    ms = [UserMessage("u"), asst(call("a")), res("a"), AssistantMessage("done")]
    assert synthesize_missing_results(ms) == ms


# -- pass 6: truncate_old_tool_results ------------------------------------------------------
def test_old_long_results_are_cut_with_a_marker() -> None:
    long = "x" * 50
    ms = [UserMessage("u"), asst(call("1")), res("1", long), asst(call("2")), res("2", long), asst(call("3")),
          res("3", long)]
    out = truncate_old_tool_results(ms, keep_last_turns=2, max_chars=10)
    assert out[2] == ToolResultMessage("1", "x" * 10 + "\n[... 40 of 50 characters cut from this old tool result]",
                                       metadata={"truncated_chars": 40})
    assert out[4] is ms[4] and out[6] is ms[6]
    out = truncate_old_tool_results(ms, keep_last_turns=1, max_chars=10)
    assert [m.metadata for m in out if isinstance(m, ToolResultMessage)] == [
        {"truncated_chars": 40}, {"truncated_chars": 40}, None]


def test_short_or_recent_results_are_kept_and_bad_options_raise() -> None:
    ms = [UserMessage("u"), asst(call("1")), res("1", "short"), AssistantMessage("a"), AssistantMessage("b")]
    assert truncate_old_tool_results(ms, keep_last_turns=1, max_chars=5) == ms
    with pytest.raises(ValueError):
        truncate_old_tool_results(ms, keep_last_turns=0)


# -- pass 7: normalize_tool_call_ids ----------------------------------------------------------
def ids(ms: list[Message]) -> list[str]:
    out = []
    for m in ms:
        if isinstance(m, AssistantMessage):
            out += [c.id for c in m.tool_calls]
        elif isinstance(m, ToolResultMessage):
            out.append(m.tool_call_id)
    return out


def test_ids_repeated_across_turns_are_renamed_with_their_results() -> None:
    ms = [UserMessage("u"), asst(call("call_0")), res("call_0", "1"), asst(call("call_0")), res("call_0", "2")]
    out = normalize_tool_call_ids(ms, OPENAI)
    new = ids(out)
    assert new[:2] == ["call_0", "call_0"] and new[2] == new[3] != "call_0"
    assert new[2].startswith("call_") and len(new[2]) == 21
    assert out[4].text == "2"
    assert normalize_tool_call_ids(ms, OPENAI) == out  # stable: same history, same ids


def test_empty_and_in_turn_duplicate_ids_get_distinct_ids_paired_in_order() -> None:
    ms = [UserMessage("u"), asst(call("", x=1), call("", x=2)), res("", "r1"), res("", "r2")]
    out = normalize_tool_call_ids(ms, GENERIC)
    c1, c2 = out[1].tool_calls  # type: ignore[union-attr]
    assert c1.id != c2.id and "" not in (c1.id, c2.id)
    assert (out[2].tool_call_id, out[2].text) == (c1.id, "r1")
    assert (out[3].tool_call_id, out[3].text) == (c2.id, "r2")


def test_illegal_characters_and_length_follow_the_protocol() -> None:
    kimi = "functions.get_weather:0"
    ms = [UserMessage("u"), asst(call(kimi)), res(kimi)]
    assert ids(normalize_tool_call_ids(ms, ANTHROPIC)) == ["functions_get_weather_0"] * 2
    assert normalize_tool_call_ids(ms, OPENAI) == ms
    long = "call_" + "a" * 60
    ms = [UserMessage("u"), asst(call(long)), res(long)]
    assert ids(normalize_tool_call_ids(ms, OPENAI)) == [long[:40]] * 2
    assert ids(normalize_tool_call_ids(ms, ANTHROPIC)) == [long[:64]] * 2


def test_a_new_id_never_takes_a_later_original_id() -> None:
    ms = [UserMessage("u"), asst(call("a.b")), res("a.b"), asst(call("a_b")), res("a_b")]
    out = ids(normalize_tool_call_ids(ms, ANTHROPIC))
    assert out[2:] == ["a_b", "a_b"] and out[0] == out[1] not in ("a_b", "a.b")


# -- the pipeline on the cases --------------------------------------------------------------
def anthropic_wire(ms: list[Message]) -> tuple[Any, list[dict[str, Any]]]:
    from fsm_agent.providers.anthropic import messages_to_wire

    return messages_to_wire(ms)


def test_b01_through_the_pipeline() -> None:
    ms = case_messages(load("B01.json")["messages"])
    out = repair_messages(ms, budget_tokens=5, count=non_system)
    assert roles(out) == load("B01.expected.json")["repaired_roles"]
    assert no_orphans(out)


@pytest.mark.parametrize("index", [0, 1])
def test_b02_through_the_pipeline_and_the_anthropic_body(index: int) -> None:
    case = load("B02.json")["cases"][index]
    want = load("B02.expected.json")[case["name"]]
    out = repair_messages(case_messages(case["messages"]), rules=ANTHROPIC)
    assert roles(out) == want["repaired_roles"]
    _, body = anthropic_wire(out)
    assert [b["role"] for b in body] == want["anthropic_body_roles"]
    if index == 0:
        assert [b["type"] for b in body[2]["content"]] == want["anthropic_message_2_content_types"]
        assert body[2]["content"][0]["is_error"] is True
        assert body[1]["content"][0] == {"type": "text", "text": "Let me look that up."}
    else:
        assert [b["type"] for b in body[-1]["content"]] == want["anthropic_merged_user_content_types"]
        assert [b.get("tool_use_id") for b in body[-1]["content"][:2]] == ["toolu_PH_10", "toolu_PH_11"]
        assert body[-1]["content"][1]["is_error"] is True and "cancelled" in body[-1]["content"][1]["content"]


def test_b04_anthropic_body() -> None:
    want = load("B04.expected.json")["anthropic"]
    out = repair_messages(case_messages(load("B04.json")["messages"]), rules=ANTHROPIC)
    _, body = anthropic_wire(out)
    assert [b["role"] for b in body] == want["roles"]
    texts = [c["text"] for b in body for c in b["content"] if c["type"] == "text"]
    assert texts == ["How many meetings do I have today?", "Hello? Did you get that?"]
    assert all(t.strip() for t in texts) is want["no_text_block_with_empty_or_whitespace_only_text"]
    assert [c["type"] for c in body[1]["content"]] == want["assistant_1_content_types"]
    assert [c["type"] for c in body[3]["content"]] == want["assistant_3_content_types"]
    assert [c["type"] for c in body[-1]["content"]] == want["last_user_content_types"]


def test_b04_openai_chat_body() -> None:
    from fsm_agent.providers.openai_chat import messages_to_wire

    want = load("B04.expected.json")["openai_chat"]
    out = repair_messages(case_messages(load("B04.json")["messages"]), rules=OPENAI)
    # the pipeline itself already dropped the blank turn and the blank text blocks
    assert roles(out) == ["user", "assistant", "tool", "assistant", "tool", "user"]
    body = messages_to_wire(tuple(out))
    assert [m["role"] for m in body] == ["user", "assistant", "tool", "assistant", "tool", "user"]
    tool_turns = [m for m in body if m.get("tool_calls")]
    assert len(tool_turns) == 2
    assert all(m["content"] is want["assistant_with_tool_calls_and_no_text_has_content"] for m in tool_turns)
    assert want["whitespace_only_assistant_message_dropped"] is not any(
        m["role"] == "assistant" and isinstance(m["content"], str) and not m["content"].strip() for m in body)


# -- MessageRepair in runs --------------------------------------------------------------------
@tool
def lookup_invoice(invoice_id: str) -> str:
    """Look up an invoice."""
    return "due 2026-02-01"


async def test_middleware_repairs_the_call_context_but_not_the_transcript() -> None:
    history = case_messages(load("B02.json")["cases"][0]["messages"])
    provider = ScriptedProvider(["It is due on 1 February."])
    result = await Agent(provider, tools=[lookup_invoice], middleware=[MessageRepair()]).run(history)
    assert result.stop.reason is StopReason.COMPLETED
    sent = list(provider.requests[0].messages)
    assert roles(sent) == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert sent[3].metadata == {"synthetic": "unavailable"}  # type: ignore[union-attr]
    assert list(result.messages[:5]) == history  # the transcript keeps what happened


async def test_trimming_uses_the_window_minus_output_and_tools() -> None:
    caps = ProviderCapabilities(context_window=1000)
    agent = Agent(ScriptedProvider(["ok"], capabilities=caps), tools=[lookup_invoice],
                  config=RunConfig(max_output_tokens=200))
    ctx = agent.new_context([UserMessage("q")])
    mw = MessageRepair()
    tools = estimate_request_tokens(MessageRequest("", (), tools=(lookup_invoice.definition,)))
    assert mw.budget(ctx) == 1000 - 200 - tools
    ctx._run.context_retry = True  # the driver's state: set here as the driver would after a context error
    assert mw.budget(ctx) == int((1000 - 200 - tools) * 0.75)
    ctx.settings.max_output_tokens = 100
    assert MessageRepair(max_context_tokens=500, retry_budget_ratio=0.5).budget(ctx) == int((500 - 100 - tools) * 0.5)
    ctx.settings.tools_enabled = False
    assert MessageRepair(max_context_tokens=500, retry_budget_ratio=1.0).budget(ctx) == 400
    assert MessageRepair().budget(Agent(ScriptedProvider([])).new_context([])) is None  # window unknown


async def test_context_length_retry_re_trims_tighter_b20() -> None:
    turns: list[Message] = [SystemMessage("s")]
    for i in range(12):
        turns += [UserMessage(f"question {i} " + "word " * 30), AssistantMessage(f"answer {i} " + "word " * 30)]
    turns.append(UserMessage("last question"))
    window = count_message_tokens(turns) // 2 + 100
    error = ContextLengthExceededError("too long", provider="scripted")
    provider = ScriptedProvider([error, "fine"], capabilities=ProviderCapabilities(context_window=window))
    result = await Agent(provider, middleware=[MessageRepair(output_reserve_tokens=100)]).run(turns)
    assert result.stop.reason is StopReason.COMPLETED
    first, second = (list(r.messages) for r in provider.requests)
    assert count_message_tokens(first) <= window - 100 < count_message_tokens(turns)
    assert count_message_tokens(second) <= int((window - 100) * 0.75)
    assert len(second) < len(first)
    for sent in (first, second):
        assert sent[0] == SystemMessage("s") and sent[1].role == "user" and sent[-1] == UserMessage("last question")


async def test_rules_follow_the_providers_protocol() -> None:
    for kind, protocol in [("anthropic", "anthropic"), ("openai", "openai-chat"), ("llamacpp", "openai-chat"),
                           ("openai-responses", "openai-responses")]:
        provider = create_provider(kind, ProviderConfig(api_key="k", model="m", base_url="http://127.0.0.1:9"))
        try:
            ctx = Agent(provider).new_context([])
            assert MessageRepair().rules(ctx) is RULES[protocol]
            assert MessageRepair(protocol="anthropic").rules(ctx) is RULES["anthropic"]
        finally:
            await provider.aclose()
    assert MessageRepair().rules(Agent(ScriptedProvider([])).new_context([])) is RULES["generic"]
    assert rules_for("something-else") is RULES["generic"]


def test_options_repr_and_placement() -> None:
    mw = MessageRepair(max_context_tokens=8000, keep_last_turns=3, tool_result_max_chars=500)
    assert repr(mw) == ("MessageRepair(max_context_tokens=8000, output_reserve_tokens=4096, retry_budget_ratio=0.75, "
                        "keep_last_turns=3, tool_result_max_chars=500, protocol=None)")
    for bad in ({"retry_budget_ratio": 0}, {"keep_last_turns": 0}, {"protocol": "smtp"}):
        with pytest.raises(ValueError):
            MessageRepair(**bad)

    class Other(Middleware):
        def pre_turn(self, ctx: Any) -> None:
            ctx.messages.append(SystemMessage("late system text"))

    agent = Agent(ScriptedProvider([]), middleware=[mw, Other()])
    assert [m.middleware_name for m in agent.middleware] == ["Other", "repair"]  # repair has the last word


async def test_later_middleware_edits_are_repaired_too() -> None:
    class Other(Middleware):
        def pre_turn(self, ctx: Any) -> None:
            ctx.messages.append(SystemMessage("late system text"))

    provider = ScriptedProvider(["ok"])
    await Agent(provider, system_prompt="first", middleware=[MessageRepair(), Other()]).run("hi")
    assert list(provider.requests[0].messages) == [SystemMessage("first\n\nlate system text"), UserMessage("hi")]


# -- pass 0: a call given twice (issue 9 item 6) ----------------------------------------------
def _call(cid: str, **args: object) -> ToolUseBlock:
    return ToolUseBlock(cid, "lookup", dict(args))


def test_a_call_repeated_in_one_turn_is_kept_once_with_one_result() -> None:
    from fsm_agent_middleware.repair import collapse_repeated_calls

    c = _call("c1", q="x")
    msgs = [UserMessage("go"), AssistantMessage((c, c)), ToolResultMessage("c1", "r1"), ToolResultMessage("c1", "r2")]
    out = repair_messages(msgs)
    assert [(m.role, [b.id for b in m.tool_calls] if m.role == "assistant" else getattr(m, "text", "")) for m in out] == [
        ("user", "go"), ("assistant", ["c1"]), ("tool", "r1")]
    assert collapse_repeated_calls(msgs)[1].tool_calls == (c,)


def test_a_call_repeated_in_a_later_turn_while_still_open_is_sent_once() -> None:
    c = _call("c9", q="y")
    msgs = [UserMessage("go"), AssistantMessage((c,)), AssistantMessage((TextBlock("again"), c)),
            ToolResultMessage("c9", "done")]
    out = repair_messages(msgs)
    calls = [b.id for m in out if m.role == "assistant" for b in m.tool_calls]
    results = [m for m in out if m.role == "tool"]
    assert calls == ["c9"] and len(results) == 1 and results[0].text == "done"


def test_an_id_reused_by_a_new_answered_call_is_a_new_call() -> None:
    a, b = _call("call_0", q="x"), _call("call_0", q="x")
    msgs = [UserMessage("go"), AssistantMessage((a,)), ToolResultMessage("call_0", "first"),
            AssistantMessage((b,)), ToolResultMessage("call_0", "second")]
    out = repair_messages(msgs)
    assert [m.text for m in out if m.role == "tool"] == ["first", "second"]
    assert len([m for m in out if m.role == "assistant"]) == 2
