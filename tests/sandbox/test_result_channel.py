"""The sandbox's result channel, on the REAL bubblewrap and subprocess (Landlock) sandboxes as root.

The code may claim in its own report only the limits its own process can see fail (``memory``,
``processes``, ``file_size``): ``cpu`` is the monitor's, ``wall`` and ``output`` the parent's, and
the exit status is the monitor's, whatever the code wrote and wherever. File names that are not
UTF-8 and lone surrogates in values, output and errors come back with escapes, encode as JSON, and
never cost the code's own error. A self-test that failed for a transient shortage (``EAGAIN`` while
the uid's processes are still being reaped) is not cached. Every sandbox error the model reads
through ``codeact_tool`` is one of the documented, typed errors. Each test failed on the code before
the fix.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_agent import Agent, ScriptedProvider, ToolResultMessage
from fsm_agent.providers import tool_call_response
from fsm_agent.sandbox import (
    ExecutionResult,
    GuaranteeNotHeldError,
    Guarantees,
    Limits,
    SandboxInputError,
    codeact_tool,
)
from fsm_agent.sandbox._local import LocalSandbox

from .conftest import UIDS, build

Make = Callable[..., LocalSandbox]

DOCUMENTED = ("SandboxError", "RemoteSandboxError", "SandboxUnavailableError", "GuaranteeNotHeldError",
              "SandboxInputError")
"""The sandbox errors docs/codeact.md lists (CodeExecutionError is the code's own: a JSON result)."""

EVERY_FD = """
import os
def forge(data):
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.write(int(name), data)
            except OSError:
                pass
"""


def encodes(r: ExecutionResult) -> dict[str, Any]:
    """What the model reads, through orjson (UTF-8 only) and back."""
    doc: dict[str, Any] = orjson.loads(orjson.dumps(r.for_model()))
    return doc


# -- the code claims only what it can know -------------------------------------------------------------
FORGERIES = {
    "json": b'{"limits": ["cpu", "wall", "output", "memory"], "exit": 0, "signal": 24, "cpu_s": 999, '
            b'"repr_truncated": true, "value_truncated": true}',
    "framed": b'\x1e{"limits": ["wall", "cpu", "processes"], "return_value": 1, "return_repr": "1"}',
    "status_line": b'M{"cpu_s": 999.0, "signal": 24}\n\x1e{"limits": ["cpu", "file_size"]}',
    "strings": b'{"limits": "cpu wall", "error": {"type": "X", "message": "forged", "line": true}}',
}


async def test_a_forged_report_names_no_limit_the_code_cannot_know(make: Make) -> None:
    """Whatever the code writes, to whichever of its descriptors, in whatever format (the runner's JSON,
    its report frame, the monitor's status line, wrong types): no ``cpu``, ``wall`` or ``output``,
    and the exit status is the one the code really ended with."""
    sb = make(limits=Limits(cpu_seconds=1, wall_seconds=20))
    for name, forged in FORGERIES.items():
        for end, status in (("os._exit(0)", 0), ("raise SystemExit(3)", 3)):
            r = await sb.run(EVERY_FD + f"forge({forged!r})\n{end}")
            assert (r.exit_code, r.signal) == (status, None), (name, r)
            assert set(r.limits_hit) <= {"memory", "processes", "file_size"}, (name, r)  # never cpu, wall, output
    r = await sb.run(EVERY_FD + f"forge({FORGERIES['strings']!r})\nos._exit(0)")
    assert r.limits_hit == () and r.error is not None and r.error.line is None, r


async def test_the_codes_own_error_survives_a_report_it_forged_first(make: Make) -> None:
    code = EVERY_FD + "forge(b'{\"limits\": []}')\nforge(b'not json at all')\nraise ValueError('the real one')"
    r = await make().run(code)
    assert r.error is not None, r
    assert (r.error.type, r.error.message, r.error.line) == ("ValueError", "the real one", len(code.splitlines())), r
    assert r.exit_code == 1 and not r.ok


# -- any text, carried with escapes --------------------------------------------------------------------
CAP = Limits().output_bytes


@pytest.mark.parametrize("text, escaped", [
    ("'\\x01' * 100_000", "\x01" * CAP),  # each byte 6 in the report's JSON
    ("'\\U0001F600' * 100_000", "\U0001F600" * (CAP // 4)),  # 12 in the report's JSON
    ("'\\ud800 lone'", "\\ud800 lone"),
    ("os.fsdecode(b'name-\\xff')", "name-\\xff"),
], ids=["control", "astral", "surrogate", "fsdecoded"])
async def test_an_error_message_of_any_text_is_kept_and_encodes(make: Make, text: str, escaped: str) -> None:
    r = await make().run(f"import os\nraise ValueError({text})")
    assert r.error is not None and r.error.type == "ValueError" and r.error.line == 2, r
    assert r.error.message.startswith(escaped) and len(r.error.message.encode()) <= CAP + 64
    doc = encodes(r)
    assert doc["error"]["type"] == "ValueError" and escaped[:100] in doc["error"]["message"]  # for_model cuts too


async def test_non_utf8_file_names_are_carried_with_escapes(make: Make) -> None:
    code = """
import os, sys
os.close(os.open(b"\\xff\\xfe.bin", os.O_CREAT | os.O_WRONLY, 0o644))
os.mkdir(b"dir-\\x80")
with open(b"dir-\\x80/inner", "wb") as fh:
    fh.write(b"12")
os.symlink(b"\\xfftarget", b"link-\\xc3")
names = sorted(os.listdir("."))
print(names[0])
sys.stderr.write(names[0] + "\\n")
open(names[0] + "-missing")
"""
    r = await make().run(code)
    assert [(f.path, f.change, f.kind, f.size) for f in r.files] == [
        ("\\xff\\xfe.bin", "created", "file", 0), ("dir-\\x80/inner", "created", "file", 2),
        ("link-\\xc3", "created", "symlink", 7)], r
    assert r.stdout == "dir-\\x80\n", r  # stdout's surrogateescape wrote the byte; it comes back escaped
    assert r.stderr.startswith("dir-\\udc80\n"), r  # stderr's own backslashreplace wrote the escape
    assert r.error is not None and r.error.type == "FileNotFoundError" and "dir-\\udc80-missing" in r.error.message, r
    doc = encodes(r)
    assert [f["path"] for f in doc["files"]] == ["\\xff\\xfe.bin", "dir-\\x80/inner", "link-\\xc3"]


async def test_a_kept_work_dir_with_non_utf8_names_is_handed_over(make: Make) -> None:
    sb = make(keep_workdir=True)
    r = await sb.run("import os\nos.mkdir(b'd\\xff')\nopen(b'd\\xff/f\\xfe', 'w').write('x')\n1")
    assert r.ok and [f.path for f in r.files] == ["d\\xff/f\\xfe"] and r.workdir is not None, r
    kept = Path(os.fsdecode(os.fsencode(r.workdir) + b"/d\xff/f\xfe"))
    assert kept.read_text() == "x" and kept.stat().st_uid == 0


async def test_lone_surrogates_in_values_and_reprs_are_escaped(make: Make) -> None:
    sb = make()
    r = await sb.run("'\\ud800'")
    assert r.ok and r.return_value is None and r.return_repr == "'\\ud800'", r
    r = await sb.run("class T:\n    def __repr__(self):\n        return 'bad \\ud800 \\udcff'\nT()")
    assert r.ok and r.return_repr == "bad \\ud800 \\xff", r
    r = await sb.run("{'\\udcff': [1, '\\ud800']}")
    assert r.ok and r.return_value is None and r.return_repr is not None
    r = await sb.run("import sys\nsys.stdout.buffer.write(b'out \\xff\\n')\nprint('ok \\u2713')")
    assert r.stdout == "out \\xff\nok \u2713\n", r
    encodes(r)


async def test_output_cut_inside_a_character_is_no_escape(make: Make) -> None:
    r = await make(limits=Limits(output_bytes=1024)).run("print('ab' + '\u2713' * 2000)")
    assert r.stdout == "ab" + "\u2713" * 340 and r.limits_hit == ("output",), r  # the 341st is cut inside


# -- a failed self-test is tested again ----------------------------------------------------------------
ZOMBIES = """
import os, sys
uid, n = int(sys.argv[1]), int(sys.argv[2])
children = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os.setgid(uid)
        os.setuid(uid)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, and left unreaped
print("ready", flush=True)
sys.stdin.read()
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def _reaped(uid: int) -> None:
    """Wait until no process of ``uid``, zombies included, is left (the host's init reaps them)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/status", "rb") as fh:
                    uids = next(line for line in fh if line.startswith(b"Uid:")).split()[1:4]
            except (OSError, StopIteration):
                continue
            if str(uid).encode() in uids:
                left.append(name)
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of uid {uid} were not reaped within 30 s: {left}")


@contextlib.contextmanager
def processes_being_reaped(uid: int, n: int) -> Iterator[Callable[[], None]]:
    """``n`` ended processes of ``uid`` not reaped yet (they count against its ``RLIMIT_NPROC``), and
    this process's soft ``RLIMIT_NPROC`` at ``n`` (what a uid starting the launcher inherits), until
    the function given is called: a transient shortage, as after a fork bomb."""
    _reaped(uid)  # what earlier tests left of this uid (a fork bomb's zombies) is gone first
    holder = subprocess.Popen([sys.executable, "-c", ZOMBIES, str(uid), str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (n, hard))

    def release() -> None:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        holder.wait()

    try:
        yield release
    finally:
        release()


async def test_a_self_test_failed_for_a_transient_shortage_is_tested_again(make: Make) -> None:
    uid = UIDS[6]  # one uid of its own, so that the self-test must run as it
    sb = make(uids=[uid])
    with processes_being_reaped(uid, 40) as release:
        failed = await sb.start()
        assert failed.not_holding() == failed.NAMES and "tested again" in failed.reasons["uid_dropped"], failed
        with pytest.raises(GuaranteeNotHeldError, match="tested again"):
            await sb.run("1")
        release()
        r = await sb.run("6 * 7")  # a later run tests again
    assert r.return_value == 42, r
    assert sb.guarantees().uid_dropped and (await sb.start()).holding() == sb.guarantees().holding()


async def test_a_failed_self_test_is_tested_again_by_start(make: Make) -> None:
    uid = UIDS[6]
    sb = make(uids=[uid])
    with processes_being_reaped(uid, 40) as release:
        assert not (await sb.start()).uid_dropped
        release()
        assert (await sb.start()).uid_dropped


# -- what the model reads --------------------------------------------------------------------------------
def _read(messages: Any) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


def _typed(result: ToolResultMessage) -> str:
    """The kind of answer the model read: ``json`` (the code's own result) or the documented error's name."""
    try:
        orjson.loads(result.text)
        return "json"
    except orjson.JSONDecodeError:
        pass
    prefix = "Tool 'run_python' failed: "
    assert result.text.startswith(prefix), result.text
    name = result.text[len(prefix):].split(":")[0]
    assert name in DOCUMENTED, result.text
    return name


async def test_the_model_reads_escaped_names_and_errors(make: Make) -> None:
    tool = codeact_tool(make())
    script = [tool_call_response(
        ("run_python", {"code": "import os\nopen(b'r\\xe9sum\\xe9.txt', 'w').close()\nsorted(os.listdir('.'))"}),
        ("run_python", {"code": "raise ValueError('\\ud800')"}),
        ("run_python", {"code": "import os\nraise ValueError(os.fsdecode(b'\\xff'))"})), "done"]
    result = await Agent(ScriptedProvider(script), tools=[tool]).run("go")
    listed, lone, byte = _read(result.messages)
    assert [_typed(m) for m in (listed, lone, byte)] == ["json"] * 3
    doc = orjson.loads(listed.text)
    assert doc["ok"] and doc["files"] == [{"path": "r\\xe9sum\\xe9.txt", "change": "created", "size": 0}], doc
    assert orjson.loads(lone.text)["error"] == {"type": "ValueError", "message": "\\ud800", "line": 1}
    assert orjson.loads(byte.text)["error"] == {"type": "ValueError", "message": "\\xff", "line": 2}


async def test_a_sandbox_failure_reaches_the_model_as_a_documented_error(make: Make) -> None:
    root = Path(tempfile.mkdtemp(prefix="fsm-channel-", dir="/tmp"))
    root.chmod(0o755)
    sb = make(workdir_root=root)
    tool = codeact_tool(sb)  # started: its self-test ran
    root.rmdir()  # the work dirs' root is gone (an operator cleaned /tmp)
    script = [tool_call_response(("run_python", {"code": "1 + 1"})), "done"]
    result = await Agent(ScriptedProvider(script), tools=[tool]).run("go")
    (answer,) = _read(result.messages)
    assert answer.is_error and _typed(answer) == "SandboxError" and str(root) in answer.text, answer.text


async def test_any_other_exception_of_a_sandbox_reaches_the_model_as_a_sandbox_error() -> None:
    class Broken:
        name = "broken"
        limits = Limits()

        async def start(self) -> Guarantees:
            return Guarantees("broken")

        def guarantees(self) -> Guarantees:
            return Guarantees("broken")

        async def run(self, code: str, *, files: Mapping[str, bytes | str] | None = None,
                      timeout: float | None = None, limits: Limits | None = None) -> ExecutionResult:
            if code == "surrogates":  # a result no sandbox of fsm_agent makes: for_model escapes it anyway
                return ExecutionResult("broken", "out \ud800", "", 1, return_value={"k": "\ud800"},
                                       return_repr="'\ud800'")
            raise KeyError("the executor lost its job table")

        async def aclose(self) -> None:
            pass

    script = [tool_call_response(("run_python", {"code": "1"}), ("run_python", {"code": "surrogates"})), "done"]
    result = await Agent(ScriptedProvider(script), tools=[codeact_tool(Broken())]).run("go")
    raised, odd = _read(result.messages)
    assert _typed(raised) == "SandboxError" and "KeyError" in raised.text
    assert _typed(odd) == "json" and orjson.loads(odd.text) == {"ok": False, "stdout": "out \\ud800",
                                                               "return_repr": "'\\ud800'", "exit_code": 1}


def test_seeded_files_a_sandbox_cannot_write_are_refused_at_construction(kind: str, reachable_dir: Path) -> None:
    sb = build(kind, workdir_root=reachable_dir)
    for bad in ({"\ud800.py": "x"}, {"ok.py": 5}, {"../up.py": "x"}):
        with pytest.raises(SandboxInputError, match="files"):
            codeact_tool(sb, files=bad)  # type: ignore[arg-type]
    for option in ({"env": {"K": "\ud800"}}, {"python": "/usr/bin/\ud800"}, {"workdir_root": "/tmp/\ud800"}):
        with pytest.raises(SandboxInputError):
            build(kind, **option)
