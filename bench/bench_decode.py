"""Provider-layer decode throughput: fsm_agent vs the official openai and anthropic SDKs.

Every streamed SSE body of the recorded corpus (``tests/corpus.py`` ``bodies()``: streaming flag set
and the body is SSE) is decoded, per protocol, by:

* ``fsm_agent`` — ``SSEDecoder`` + the protocol's ``stream_parser()`` + ``finish()``, i.e.
  ``HttpProvider.decode_stream_bytes`` (typed StreamEvents and the aggregated final response);
* ``fsm_agent SSE only`` — the ``SSEDecoder`` alone (where the time of the line above goes);
* ``openai SSE only`` / ``anthropic SSE only`` — the SDK's ``_streaming.SSEDecoder.iter_bytes`` alone;
* ``openai Stream`` / ``anthropic Stream`` — the SDK's public ``Stream[T]`` iterated over an
  ``httpx2.Response`` built from the bytes (SSE decoding, ``json.loads``, typed chunk objects:
  exactly what ``client.….create(stream=True)`` yields, minus the network);
* ``openai Stream+accumulate`` / ``anthropic Stream+accumulate`` — the SDK's own accumulation helper
  over that ``Stream`` (``ChatCompletionStream`` / ``ResponseStream`` / ``MessageStream``, what
  ``.stream()`` uses) down to the final completion / response / message: the like-for-like
  counterpart of fsm_agent's path, which also ends in one aggregated response.

Rounds alternate the order of the decoders; each timed block is one pass over the protocol's
bodies that every decoder of that protocol decodes without raising (the "common set"), after a
full GC. CPU seconds (``time.process_time``) are the measure (decoding is single-threaded and CPU
bound; CPU time is less disturbed than wall time by other load on a shared machine); wall time is
kept in the JSON. Reported: medians over rounds of MB/s and SSE events/s (events = data events
dispatched by fsm_agent's decoder, the same count for every decoder) and CPU µs per event, and the
ratio of each decoder's median CPU time to fsm_agent's.

Bodies a decoder raises on are listed (a stream that carries an error event is expected to raise
in every decoder; those are marked "error stream"). Final results of the accumulating SDK paths
that differ from fsm_agent's (text, tool calls, role) are listed too, with both values, so that a
reader can judge which side is right; DESIGN.md §9 and shared/cases say what the right answer is.
The bug cases ``shared/cases/B*.sse`` (all Chat Completions) are run through the same decoders
for the failure list only.

    python bench/bench_decode.py            # default: 11 rounds
    python bench/bench_decode.py --quick    # 3 rounds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/corpus.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # measure the tree this script sits in
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CpuTimer, machine, median, rotate, say, spread, table, versions, write_results  # noqa: E402

from fsm_agent.errors import ProviderError  # noqa: E402
from fsm_agent.providers.decode import decoder_for, looks_like_sse  # noqa: E402
from fsm_agent.providers.sse import SSEDecoder  # noqa: E402
from fsm_agent.types.stream import MessageComplete  # noqa: E402

PROTOCOLS = ("openai-chat", "openai-responses", "anthropic")
Decode = Callable[[bytes], Any]


def split(raw: bytes, chunk: int) -> list[bytes]:
    return [raw] if chunk <= 0 else [raw[i:i + chunk] for i in range(0, len(raw), chunk)]


# ------------------------------------------------------------------------------------ fsm_agent
def fsm_decoders(protocol: str, chunk: int) -> dict[str, Decode]:
    provider = decoder_for(protocol)

    def full(raw: bytes) -> Any:
        if chunk <= 0:
            events = provider.decode_stream_bytes(raw)
        else:  # the same loop as decode_stream_bytes, fed in reads of `chunk` bytes
            decoder = SSEDecoder(provider.config.max_event_bytes)
            parser = provider.stream_parser()
            events = []
            for piece in split(raw, chunk):
                for sse in decoder.feed(piece):
                    events.extend(parser.feed(sse))
            for sse in decoder.flush():
                events.extend(parser.feed(sse))
            events.extend(parser.finish())
        return next(e.full_response for e in reversed(events) if isinstance(e, MessageComplete))

    def sse_only(raw: bytes) -> int:
        decoder = SSEDecoder()
        n = 0
        for piece in split(raw, chunk):
            n += len(decoder.feed(piece))
        return n + len(decoder.flush())

    return {"fsm_agent": full, "fsm_agent SSE only": sse_only}


def sse_events(raw: bytes) -> int:
    d = SSEDecoder()
    return len(d.feed(raw)) + len(d.flush())


# ------------------------------------------------------------------------------------ SDKs
class Missing(Exception):
    pass


def openai_decoders(protocol: str, chunk: int) -> dict[str, Decode]:
    try:
        import httpx2
        import openai
        from openai._streaming import SSEDecoder as OpenAISSE
    except ImportError as exc:
        raise Missing(f"openai SDK not importable ({exc})") from exc
    client = openai.OpenAI(api_key="bench", base_url="http://127.0.0.1:9/v1", max_retries=0)
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/x")
    headers = {"content-type": "text/event-stream"}

    def response(raw: bytes) -> Any:
        return httpx2.Response(200, headers=headers, content=raw if chunk <= 0 else iter(split(raw, chunk)),
                               request=request)

    if protocol == "openai-chat":
        from openai.lib.streaming.chat import ChatCompletionStream
        from openai.types.chat import ChatCompletionChunk as cast_to

        def accumulate(raw: bytes) -> Any:
            s = ChatCompletionStream(raw_stream=openai.Stream(cast_to=cast_to, response=response(raw), client=client),
                                     response_format=openai.omit, input_tools=openai.omit)
            return s.get_final_completion()
    else:
        from openai.lib.streaming.responses import ResponseStream
        from openai.types.responses import ResponseStreamEvent as cast_to  # type: ignore[assignment]

        def accumulate(raw: bytes) -> Any:
            s = ResponseStream(raw_stream=openai.Stream(cast_to=cast_to, response=response(raw), client=client),
                               text_format=openai.omit, input_tools=openai.omit, starting_after=None)
            return s.get_final_response()

    def stream(raw: bytes) -> int:
        n = 0
        for _ in openai.Stream(cast_to=cast_to, response=response(raw), client=client):
            n += 1
        return n

    def sse_only(raw: bytes) -> int:
        return sum(1 for _ in OpenAISSE().iter_bytes(iter(split(raw, chunk))))

    return {"openai SSE only": sse_only, "openai Stream": stream, "openai Stream+accumulate": accumulate}


def anthropic_decoders(chunk: int) -> dict[str, Decode]:
    try:
        import anthropic
        import httpx2
        from anthropic._streaming import SSEDecoder as AnthropicSSE
        from anthropic.lib.streaming import MessageStream
        from anthropic.types import RawMessageStreamEvent as cast_to
    except ImportError as exc:
        raise Missing(f"anthropic SDK not importable ({exc})") from exc
    client = anthropic.Anthropic(api_key="bench", base_url="http://127.0.0.1:9", max_retries=0)
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/messages")
    headers = {"content-type": "text/event-stream"}

    def response(raw: bytes) -> Any:
        return httpx2.Response(200, headers=headers, content=raw if chunk <= 0 else iter(split(raw, chunk)),
                               request=request)

    def stream(raw: bytes) -> int:
        n = 0
        for _ in anthropic.Stream(cast_to=cast_to, response=response(raw), client=client):
            n += 1
        return n

    def accumulate(raw: bytes) -> Any:
        raw_stream = anthropic.Stream(cast_to=cast_to, response=response(raw), client=client)
        return MessageStream(raw_stream, anthropic.NOT_GIVEN).get_final_message()

    def sse_only(raw: bytes) -> int:
        return sum(1 for _ in AnthropicSSE().iter_bytes(iter(split(raw, chunk))))

    return {"anthropic SSE only": sse_only, "anthropic Stream": stream, "anthropic Stream+accumulate": accumulate}


# ------------------------------------------------------------------ comparing final results
def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a) if a.strip() else {}
        except ValueError:
            return a
    return a


def summary_fsm(resp: Any) -> dict[str, Any]:
    return {"text": resp.text or "", "tools": [(c.name, dict(c.input)) for c in resp.tool_calls]}


def summary_sdk(protocol: str, final: Any) -> dict[str, Any]:
    if protocol == "openai-chat":
        msg = final.choices[0].message if final.choices else None
        if msg is None:
            return {"text": "", "tools": [], "role": None}
        return {"text": msg.content or "", "role": msg.role,
                "tools": [(t.function.name, _args(t.function.arguments)) for t in msg.tool_calls or ()]}
    if protocol == "openai-responses":
        text = "".join(c.text for it in final.output if it.type == "message" for c in it.content
                       if getattr(c, "type", "") == "output_text")
        tools = [(it.name, _args(it.arguments)) for it in final.output if it.type == "function_call"]
        return {"text": text, "tools": tools}
    text = "".join(b.text for b in final.content if b.type == "text")
    tools = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    return {"text": text, "tools": tools}


def differences(fsm: dict[str, Any], sdk: dict[str, Any]) -> list[str]:
    out = []
    role = sdk.get("role")
    if role not in (None, "assistant"):
        out.append(f"role {role[:27] + '…' if len(role) > 28 else role!r} ({len(role)} chars)")
    if fsm["text"] != sdk["text"]:
        out.append(f"text: fsm_agent {fsm['text'][:60]!r} vs SDK {sdk['text'][:60]!r}")
    if [t[0] for t in fsm["tools"]] != [t[0] for t in sdk["tools"]]:
        out.append(f"tool names: fsm_agent {[t[0] for t in fsm['tools']]} vs SDK {[t[0] for t in sdk['tools']]}")
    elif [t[1] for t in fsm["tools"]] != [t[1] for t in sdk["tools"]]:
        out.append(f"tool arguments: fsm_agent {str([t[1] for t in fsm['tools']])[:80]} vs SDK "
                   f"{str([t[1] for t in sdk['tools']])[:80]}")
    return out


def short_error(exc: BaseException) -> str:
    msg = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {msg[:110]}"


# ------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description="SSE + protocol decode throughput: fsm_agent vs the openai/anthropic SDKs")
    ap.add_argument("--quick", action="store_true", help="3 rounds (about 20 s)")
    ap.add_argument("--rounds", type=int, help="measured rounds per protocol (default 11; --quick 3)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="feed bodies in reads of this many bytes (default 0: the whole body in one read)")
    ap.add_argument("--profile", metavar="PROTOCOL", choices=PROTOCOLS,
                    help="only cProfile fsm_agent's decoder over PROTOCOL's bodies and print the top functions")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 11)

    import corpus

    if not (corpus.CORPUS / "bodies" / "MANIFEST.tsv").exists():
        say(f"bench_decode: the recorded corpus is not at {corpus.CORPUS}; set FSM_AGENT_SHARED to the shared/ "
            "folder that holds corpus/ and cases/")
        return 2
    all_bodies = corpus.bodies()
    streamed = [b for b in all_bodies if b.streaming]
    sse_bodies = [b for b in streamed if looks_like_sse(b.data)]
    skipped = [b for b in streamed if not looks_like_sse(b.data)]
    cases = sorted((corpus.CASES).glob("B*.sse"))

    if args.profile:
        import cProfile
        import pstats

        dec = fsm_decoders(args.profile, args.chunk)["fsm_agent"]
        bodies = [b for b in sse_bodies if b.protocol == args.profile]
        ok = []
        for b in bodies:
            try:
                dec(b.data)
                ok.append(b)
            except Exception:  # noqa: BLE001
                pass
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            for b in ok:
                dec(b.data)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0

    say(f"bench_decode: {len(sse_bodies)} streamed SSE bodies ({sum(len(b.data) for b in sse_bodies):,} bytes) "
        f"from corpus/bodies; {len(skipped)} streamed-flag bodies are not SSE (error statuses: "
        f"{', '.join(sorted({str(b.status) for b in skipped})) or 'none'}) and are skipped; "
        f"{rounds} rounds; reads of {args.chunk or 'whole-body'} bytes")

    results: dict[str, Any] = {"machine": machine(), "versions": versions(), "rounds": rounds, "chunk": args.chunk,
                               "protocols": {}, "absent": {}, "failures": [], "differences": [], "cases": []}
    tables: list[str] = []
    for protocol in PROTOCOLS:
        t_proto = time.perf_counter()
        decoders = fsm_decoders(protocol, args.chunk)
        try:
            if protocol == "anthropic":
                decoders.update(anthropic_decoders(args.chunk))
            else:
                decoders.update(openai_decoders(protocol, args.chunk))
        except Missing as exc:
            say(f"  {protocol}: SDK ABSENT — {exc}; measuring fsm_agent alone")
            results["absent"][protocol] = str(exc)
        bodies = [b for b in sse_bodies if b.protocol == protocol]
        # validation pass (also the warm-up): who decodes what, and do the final results agree?
        ok: dict[str, set[str]] = {name: set() for name in decoders}
        fsm_final: dict[str, Any] = {}
        for b in bodies:
            for name, fn in decoders.items():
                try:
                    out = fn(b.data)
                    ok[name].add(b.id)
                except Exception as exc:  # noqa: BLE001 - recorded, never fatal
                    results["failures"].append({"protocol": protocol, "body": b.id, "decoder": name,
                                                "fsm_agent_error_too": None, "error": short_error(exc)})
                    continue
                if name == "fsm_agent":
                    fsm_final[b.id] = summary_fsm(out)
                elif name.endswith("+accumulate") and b.id in fsm_final:
                    try:
                        diff = differences(fsm_final[b.id], summary_sdk(protocol, out))
                    except Exception as exc:  # noqa: BLE001
                        diff = [f"could not compare: {short_error(exc)}"]
                    if diff:
                        results["differences"].append({"protocol": protocol, "body": b.id, "decoder": name,
                                                       "diff": diff})
        for f in results["failures"]:
            if f["protocol"] == protocol and f["fsm_agent_error_too"] is None:
                f["fsm_agent_error_too"] = f["body"] not in ok["fsm_agent"]
        common = [b for b in bodies if all(b.id in s for s in ok.values())]
        nbytes = sum(len(b.data) for b in common)
        nevents = sum(sse_events(b.data) for b in common)
        cpu: dict[str, list[float]] = {n: [] for n in decoders}
        wall: dict[str, list[float]] = {n: [] for n in decoders}
        names = list(decoders)
        for r in range(rounds):
            for name in rotate(names, r):
                fn = decoders[name]
                with CpuTimer() as t:
                    for b in common:
                        fn(b.data)
                cpu[name].append(t.cpu)
                wall[name].append(t.wall)
        base = median(cpu["fsm_agent"])
        rows = []
        proto_res: dict[str, Any] = {"bodies": len(bodies), "common_bodies": len(common), "common_bytes": nbytes,
                                     "common_sse_events": nevents, "decoders": {}}
        for name in names:
            c = median(cpu[name])
            res = {"cpu_s_rounds": cpu[name], "wall_s_rounds": wall[name], "cpu_s_median": c,
                   "mb_per_s": nbytes / c / 1e6 if c else None, "events_per_s": nevents / c if c else None,
                   "cpu_us_per_event": c / nevents * 1e6 if nevents else None,
                   "ratio_vs_fsm_agent": c / base if base else None, "spread": spread(cpu[name]),
                   "bodies_ok": len(ok[name]), "bodies_failed": len(bodies) - len(ok[name])}
            proto_res["decoders"][name] = res
            rows.append([name, res["mb_per_s"], res["events_per_s"], res["cpu_us_per_event"],
                         f"{res['ratio_vs_fsm_agent']:.2f}×", f"±{res['spread'] * 100:.0f}%" if res["spread"] == res["spread"] else "—",
                         f"{len(ok[name])}/{len(bodies)}"])
        results["protocols"][protocol] = proto_res
        tables.append(table(["decoder", "MB/s", "events/s", "CPU µs/event", "CPU time vs fsm_agent", "±IQR/2",
                             "bodies decoded"], rows,
                            title=f"{protocol}: {len(common)} bodies decoded by all, {nbytes:,} bytes, "
                                  f"{nevents:,} SSE events (medians of {rounds} rounds, CPU time)"))
        say(tables[-1])
        say(f"({protocol} took {time.perf_counter() - t_proto:.0f} s)")

    # the bug cases (failure list only)
    case_decoders = fsm_decoders("openai-chat", args.chunk)
    try:
        case_decoders.update(openai_decoders("openai-chat", args.chunk))
    except Missing:
        pass
    for path in cases:
        raw = path.read_bytes()
        for name, fn in case_decoders.items():
            if name.endswith("SSE only"):
                continue
            try:
                fn(raw)
                results["cases"].append({"case": path.name, "decoder": name, "ok": True})
            except Exception as exc:  # noqa: BLE001
                results["cases"].append({"case": path.name, "decoder": name, "ok": False, "error": short_error(exc)})

    say("\n### Bodies a decoder raised on (error streams are expected to raise everywhere)\n")
    fails = results["failures"]
    if not fails:
        say("none")
    for f in fails:
        tag = "error stream (fsm_agent raises too)" if f["fsm_agent_error_too"] else "fsm_agent decodes it"
        say(f"- [{f['protocol']}] {f['body']} — {f['decoder']}: {f['error']}  ({tag})")
    say("\n### Final results of the accumulating SDK paths that differ from fsm_agent's\n")
    if not results["differences"]:
        say("none")
    for d in results["differences"]:
        say(f"- [{d['protocol']}] {d['body']} — {d['decoder']}: " + "; ".join(d["diff"]))
    say("\n### Bug cases shared/cases/B*.sse (Chat Completions)\n")
    for c in results["cases"]:
        if not c["ok"]:
            say(f"- {c['case']} — {c['decoder']}: {c['error']}")
    ok_cases = sorted({c["case"] for c in results["cases"]} - {c["case"] for c in results["cases"] if not c["ok"]})
    say(f"decoded by every decoder: {', '.join(ok_cases) or 'none'}")
    sdk_fail_bodies = {(f["protocol"], f["body"]) for f in results["failures"]
                       if not f["decoder"].startswith("fsm_agent") and not f["fsm_agent_error_too"]}
    sdk_diff_bodies = {(d["protocol"], d["body"]) for d in results["differences"]}
    say(f"\nSDK paths fail on {len(sdk_fail_bodies)} and give a different final result on "
        f"{len(sdk_diff_bodies - sdk_fail_bodies)} more of the {len(sse_bodies)} streamed bodies that fsm_agent decodes "
        f"(see the lists above for which side is right).")
    results["summary"] = {"sdk_failed_bodies": sorted(map(list, sdk_fail_bodies)),
                          "sdk_different_bodies": sorted(map(list, sdk_diff_bodies - sdk_fail_bodies))}
    path = write_results("decode", results)
    say(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    try:
        rc = main()
    except Exception:
        traceback.print_exc()
        rc = 1
    print(f"(bench_decode took {time.perf_counter() - t0:.0f} s)")
    sys.exit(rc)
