"""Resume a session in a fresh process with tracing on, and print its finished spans as JSON (one
object per line): the other half of test_an_approval_wait_and_a_resume_in_a_new_process.

    python _resume_worker.py STORE_PATH SESSION_ID CALL_ID
"""

from __future__ import annotations

import asyncio
import json
import sys

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fsm_agent import Agent, Decision, ScriptedProvider, SQLiteStore
from fsm_agent.otel import OtelSettings

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _approval import approval_agent_parts  # noqa: E402


async def main(path: str, sid: str, call_id: str) -> None:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    store = SQLiteStore(path)
    tools, middleware = approval_agent_parts()
    agent = Agent(ScriptedProvider(["paid"]), tools=tools, middleware=middleware, store=store,
                  instrument=OtelSettings(tracer_provider=tp))
    result = await agent.resume(sid, decisions={call_id: Decision.approve()})
    await store.close()
    for s in exporter.get_finished_spans():
        print(json.dumps({
            "name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
            "parent": s.parent.span_id if s.parent else None, "attributes": {k: (list(v) if isinstance(v, tuple) else v)
                                                                             for k, v in s.attributes.items()},
            "links": [{"trace_id": lk.context.trace_id, "span_id": lk.context.span_id,
                       "attributes": dict(lk.attributes or {})} for lk in s.links],
            "events": [e.name for e in s.events]}))
    print(json.dumps({"stop": result.stop.reason.value}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
