"""What a run returns when the code pushes at the edges, on the REAL sandboxes as root: integers beyond
64 bits and deeply nested values keep their exact ``repr`` and never reach the model as wrong floats
or as JSON its readers refuse; non-finite limits and timeouts are refused; the report survives code
that used up its file descriptors, or raised with a huge message, or replaced ``json.dumps``; a run
that floods its output is killed instead of being read for its whole wall time; a sandbox that keeps
work dirs does not keep its self-test's; uids bwrap cannot take are refused. Each test failed on the
code before the fix.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from fsm_agent.sandbox import HttpRemoteExecutor, Limits, SandboxInputError, SubprocessSandbox, codeact_tool
from fsm_agent.sandbox._local import LocalSandbox

Make = Callable[..., LocalSandbox]


async def test_integers_beyond_64_bits_keep_their_digits(make: Make) -> None:
    sb = make(limits=Limits(output_bytes=4096))
    r = await sb.run("import math\nmath.factorial(25)")
    assert r.ok and r.return_value is None and r.return_repr == "15511210043330985984000000"
    assert orjson.loads(orjson.dumps(r.for_model())) == {"ok": True, "return_repr": "15511210043330985984000000"}
    for code, value in (("2**63 - 1", 2**63 - 1), ("-2**63", -(2**63)), ("2**64 - 1", 2**64 - 1)):
        r = await sb.run(code)
        assert r.return_value == value and isinstance(r.return_value, int)
    r = await sb.run("{'k': [2**70]}")
    assert r.return_value is None and r.return_repr == "{'k': [1180591620717411303424]}"
    r = await sb.run("10**5000")  # beyond str()'s default 4300 digits: still the digits, cut at the cap
    assert r.return_repr == "1" + "0" * 4095 and r.limits_hit == ("output",)


async def test_a_value_nested_too_deep_for_json_readers_is_given_by_its_repr(make: Make) -> None:
    r = await make().run("x = []\nfor i in range(300):\n    x = [x]\nx")
    assert r.ok and r.return_value is None and r.return_repr is not None and r.return_repr.startswith("[[[")
    orjson.dumps(r.for_model())  # orjson refuses more than 255 levels: the model's answer must still encode


async def test_a_forged_report_with_a_huge_integer_never_becomes_a_float(make: Make) -> None:
    r = await make().run("""
import os
fd = max(int(x) for x in os.listdir("/proc/self/fd") if int(x) > 2)
os.write(fd, b'{"return_value": 15511210043330985984000000, "return_repr": "x", "limits": []}')
os._exit(0)
""")
    assert r.return_value is None and not isinstance(r.return_value, float)


def test_non_finite_limits_and_timeouts_are_refused() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(SandboxInputError, match="finite"):
            Limits(wall_seconds=bad)
        with pytest.raises(SandboxInputError, match="timeout_margin must be a finite positive"):
            HttpRemoteExecutor("http://127.0.0.1:1", timeout_margin=bad)
        with pytest.raises(SandboxInputError, match="timeout_margin must be a finite positive"):
            codeact_tool(SubprocessSandbox(), timeout_margin=bad)
    with pytest.raises(SandboxInputError, match="at most 2\\*\\*62"):
        Limits(memory_bytes=2**70)


async def test_a_non_finite_run_timeout_is_refused(make: Make) -> None:
    sb = make()
    for bad in (math.nan, math.inf):
        started = time.monotonic()
        with pytest.raises(SandboxInputError, match="timeout must be a finite positive number"):
            await sb.run("import time; time.sleep(3)", timeout=bad)
        assert time.monotonic() - started < 2  # refused, not run


async def test_the_report_survives_code_that_used_up_its_file_descriptors(make: Make) -> None:
    sb = make(limits=Limits(open_files=32))
    hold = "import os\nheld = []\ntry:\n    while True:\n        held.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError:\n    pass\n"
    r = await sb.run(hold + "raise ValueError('after EMFILE')")
    assert r.error is not None and (r.error.type, r.error.message) == ("ValueError", "after EMFILE"), r
    r = await sb.run(hold + "len(held) > 10")
    assert r.return_value is True, r


async def test_a_huge_exception_message_is_cut_and_the_error_kept(make: Make) -> None:
    r = await make(limits=Limits(output_bytes=4096)).run("raise ValueError('m' * 300_000)")
    assert r.error is not None and r.error.type == "ValueError" and r.error.line == 1
    assert r.error.message.startswith("m" * 4096) and "characters cut" in r.error.message
    assert len(r.error.message) < 4200 and len(r.error.traceback) < 4200


async def test_code_that_replaces_json_dumps_still_gets_its_report(make: Make) -> None:
    r = await make().run("import json\njson.dumps = lambda *a, **k: 1 / 0\n9")
    assert r.ok and r.return_value == 9, r


async def test_a_run_flooding_its_output_is_killed(make: Make) -> None:
    sb = make(limits=Limits(output_bytes=4096))
    started = time.monotonic()
    r = await sb.run("import os\nb = b'x' * (1 << 20)\nwhile True:\n    os.write(1, b)", timeout=15)
    assert r.limits_hit == ("output",) and r.signal_name == "SIGKILL" and not r.ok, r
    assert len(r.stdout) == 4096 and 64 * 4096 < r.stdout_bytes < 64 * 4096 + 4 * (1 << 20)
    assert time.monotonic() - started < 8  # killed at the ceiling, not read for the whole wall time
    r = await sb.run("print('a' * 200_000)\n'done'")  # below the ceiling: cut, and the run goes on
    assert r.ok and r.return_value == "done" and r.limits_hit == ("output",)


async def test_a_sandbox_that_keeps_work_dirs_does_not_keep_its_self_tests(make: Make, reachable_dir: Path) -> None:
    root = reachable_dir / "kept"
    root.mkdir()
    root.chmod(0o755)
    sb = make(workdir_root=root, keep_workdir=True)
    await sb.start()
    assert list(root.iterdir()) == []
    r = await sb.run("open('a', 'w').write('1')")
    assert r.workdir is not None and [p.name for p in root.iterdir()] == [Path(r.workdir).parent.name]


def test_uids_bwrap_cannot_take_are_refused() -> None:
    for bad in ([2**31 - 1], [2**31], [2**32 - 2], [0], [-5]):
        with pytest.raises(SandboxInputError, match="between 1 and 2147483646"):
            SubprocessSandbox(uids=bad)


async def test_concurrent_runs_keep_their_reports_apart(make: Make) -> None:
    sb = make()
    results = await asyncio.gather(*(sb.run(f"import time\ntime.sleep(0.1)\n{i} * 7") for i in range(6)))
    assert [r.return_value for r in results] == [i * 7 for i in range(6)]
