"""Attack probes and positive checks on the REAL bubblewrap and subprocess sandboxes, as root.

Every probe runs model-style code in a real sandbox (setpriv, bwrap, seccomp, prlimit, CPython) and
checks on the host side that the attack did not get through: the test's own loopback listener and
DNS server saw nothing, the host file is unchanged, the secret never came back, the fork bomb stopped
well below its bound, the limit that fired is reported. Where a mechanism cannot block a probe on
this machine (the subprocess sandbox has no mount namespace), the test proves the attack works and
that ``guarantees()`` reports the property as not holding: never a silent pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_agent.errors import ConfigurationError, UserError
from fsm_agent.sandbox import (
    GUARANTEE_NAMES,
    BubblewrapSandbox,
    FileChange,
    GuaranteeNotHeldError,
    Limits,
    SandboxInputError,
    SubprocessSandbox,
)
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.sandbox._uids import BUSY_UIDS, processes_of

from .conftest import UIDS

Make = Callable[..., LocalSandbox]


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A host directory every uid may enter (0755, root-owned), outside any work dir."""
    d = Path(tempfile.mkdtemp(prefix="fsm-probe-host-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    d.rmdir()


# -- network ----------------------------------------------------------------------------------------
async def test_network_connect_to_a_loopback_listener_is_blocked(make: Make) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
    s.sendall(b"stolen")
    print("CONNECTED")
except OSError as exc:
    print("blocked:", type(exc).__name__, exc.errno)
"""
        sb = make()
        r = await sb.run(code)
        assert r.ok, r
        assert "CONNECTED" not in r.stdout and r.stdout.startswith("blocked:")
        with pytest.raises(BlockingIOError):  # the listener was never reached
            listener.accept()
        assert sb.guarantees().network_isolated
        assert "PermissionError 13" in r.stdout or "ENETUNREACH" in r.stdout or "101" in r.stdout
    finally:
        listener.close()


async def test_dns_lookup_is_blocked_and_a_query_never_reaches_a_resolver(make: Make) -> None:
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a DNS server of the test's own, on loopback
    resolver.bind(("127.0.0.1", 0))
    resolver.setblocking(False)
    port = resolver.getsockname()[1]
    query = bytes.fromhex("abcd01000001000000000000076578616d706c6503636f6d0000010001")  # example.com A
    try:
        code = f"""
import socket
out = []
try:
    out.append(socket.getaddrinfo("example.com", 443)[0][4][0])
except OSError as exc:
    out.append("getaddrinfo failed: " + type(exc).__name__)
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto({query!r}, ("127.0.0.1", {port}))
    out.append("QUERY SENT")
except OSError as exc:
    out.append("udp blocked: " + type(exc).__name__)
out
"""
        r = await make().run(code)
        assert r.ok, r
        assert r.return_value[0] == "getaddrinfo failed: gaierror"
        assert r.return_value[1] == "udp blocked: PermissionError"
        with pytest.raises(BlockingIOError):
            resolver.recvfrom(512)  # nothing arrived
    finally:
        resolver.close()


# -- filesystem -------------------------------------------------------------------------------------
async def test_writes_outside_the_work_dir_leave_the_host_untouched(make: Make, host_dir: Path) -> None:
    target = host_dir / "host.txt"
    target.write_text("original")
    target.chmod(0o644)
    code = f"""
import os
out = {{}}
for path in ({str(target)!r}, "/etc/fsm-probe", "/usr/fsm-probe", "/fsm-probe", {str(host_dir / "new.txt")!r}):
    try:
        with open(path, "w") as fh:
            fh.write("pwned")
        out[path] = "WRITTEN"
    except OSError as exc:
        out[path] = type(exc).__name__
out
"""
    r = await make().run(code)
    assert r.ok, r
    assert "WRITTEN" not in r.return_value.values(), r.return_value
    assert target.read_text() == "original" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not (host_dir / "new.txt").exists()
    for p in ("/etc/fsm-probe", "/usr/fsm-probe", "/fsm-probe"):
        assert not os.path.exists(p)


async def test_world_writable_tmp_is_private_or_refused(make: Make, kind: str) -> None:
    marker = f"/tmp/fsm-probe-{uuid.uuid4().hex}"
    sb = make()
    try:
        r = await sb.run(f"""
try:
    open({marker!r}, 'w').write('x')
    out = 'written'
except OSError as exc:
    out = type(exc).__name__
out
""")
        g = sb.guarantees()
        assert not os.path.exists(marker)  # the host's /tmp never got it
        if kind == "bubblewrap" or g.details["landlock_abi"] < 1:
            assert r.return_value == "written"  # the sandbox's private tmpfs (bubblewrap)
            assert g.filesystem_readonly
        else:
            assert r.return_value == "PermissionError"  # Landlock: writes only beneath the work dir
            assert g.filesystem_readonly and "Landlock" in g.mechanisms["filesystem_readonly"]
    finally:
        if os.path.exists(marker):
            os.unlink(marker)


async def test_bubblewraps_private_tmpfs_are_bounded_and_dev_is_read_only(reachable_dir: Path) -> None:
    """A tmpfs holds memory that RLIMIT_AS does not count: /tmp and /dev/shm are capped, /dev is read-only."""
    from .conftest import absence, build

    why = absence("bubblewrap")
    if why:
        pytest.skip(why)
    sb = build("bubblewrap", workdir_root=reachable_dir, tmp_bytes=8 * 1024 * 1024)
    r = await sb.run("""
import errno
out = {}
for d in ("/tmp", "/dev/shm", "/dev"):
    written = 0
    try:
        for i in range(16):
            with open(f"{d}/fill{i}", "wb") as fh:
                fh.write(b"x" * (1024 * 1024))
            written += 1
        out[d] = written
    except OSError as exc:
        out[d] = [written, errno.errorcode[exc.errno]]
out
""")
    assert r.ok, r
    assert r.return_value["/tmp"][1] == "ENOSPC" and r.return_value["/tmp"][0] <= 8  # of 16 MiB
    assert r.return_value["/dev/shm"][1] == "ENOSPC" and r.return_value["/dev/shm"][0] <= 8
    assert r.return_value["/dev"] == [0, "EROFS"]


async def test_etc_shadow_and_a_mode_600_secret_cannot_be_read(make: Make, host_dir: Path) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    path = host_dir / "secret.key"
    path.write_text(secret)
    path.chmod(0o600)
    shadow_head = Path("/etc/shadow").read_text().splitlines()[0]
    code = f"""
out = {{}}
for p in ("/etc/shadow", {str(path)!r}):
    try:
        out[p] = open(p).read()
    except OSError as exc:
        out[p] = "refused: " + type(exc).__name__
out
"""
    r = await make().run(code)
    assert r.ok, r
    everything = r.stdout + r.stderr + repr(r.return_value)
    assert secret not in everything and shadow_head not in everything
    assert all(v.startswith("refused: ") for v in r.return_value.values()), r.return_value


async def test_world_readable_host_files_are_invisible_or_reported_as_readable(make: Make, kind: str,
                                                                                host_dir: Path) -> None:
    marker = f"public-{uuid.uuid4().hex}"
    path = host_dir / "public.txt"
    path.write_text(marker)
    path.chmod(0o644)
    sb = make()
    r = await sb.run(f"""
try:
    text = open({str(path)!r}).read()
except OSError as exc:
    text = type(exc).__name__
text
""")
    g = sb.guarantees()
    if kind == "bubblewrap":
        assert r.return_value == "FileNotFoundError" and g.secrets_invisible
    elif g.details["landlock_abi"] >= 1:
        assert r.return_value == "PermissionError" and g.secrets_invisible  # Landlock: reads only /usr ...
    else:
        assert r.return_value == marker  # ordinary permissions only: the report must say so
        assert not g.secrets_invisible and "world-readable" in g.reasons["secrets_invisible"]


async def test_an_api_key_in_the_parents_environment_is_not_visible(make: Make,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"sk-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    code = f"""
import os
found = []
if any({key!r} in v for v in os.environ.values()):
    found.append("os.environ")
try:
    pids = os.listdir("/proc")
except OSError:
    pids = []  # the subprocess sandbox under Landlock: no other process's /proc at all
for pid in pids:
    if pid.isdigit():
        for part in ("environ", "cmdline"):
            try:
                if {key[:12]!r}.encode() in open(f"/proc/{{pid}}/{{part}}", "rb").read():
                    found.append(f"/proc/{{pid}}/{{part}}")
            except OSError:
                pass
print(sorted(os.environ))
found
"""
    r = await make().run(code)
    assert r.ok, r
    assert r.return_value == []
    assert "OPENAI_API_KEY" not in r.stdout and key not in r.stdout
    assert set(eval(r.stdout)) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD"}  # noqa: S307 - our own list


# -- processes, memory, CPU, wall -------------------------------------------------------------------
FORK_BOMB = """
import os, time
n = 0
try:
    for i in range(600):
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
finally:
    print("children", n)
"""


async def test_a_bounded_fork_bomb_stops_well_below_its_bound(make: Make) -> None:
    sb = make(limits=Limits(processes=16))
    started = time.monotonic()
    r = await sb.run(FORK_BOMB)
    children = int(r.stdout.split()[-1])
    assert 0 < children < 16, r.stdout  # of 600
    assert r.error is not None and r.error.type == "BlockingIOError"
    assert r.limits_hit == ("processes",)
    assert time.monotonic() - started < 10  # the sleeping children were killed, not waited for
    assert sb.guarantees().processes_limited
    # the autouse fixture checks that none of them is left running


async def test_two_gib_of_memory_is_refused(make: Make) -> None:
    r = await make(limits=Limits(memory_bytes=512 * 1024 * 1024)).run("b = bytearray(2 * 1024 ** 3)\nlen(b)")
    assert r.error is not None and r.error.type == "MemoryError"
    assert r.limits_hit == ("memory",)
    assert not r.ok and r.return_value is None


async def test_a_20_second_busy_loop_is_killed_by_the_cpu_limit(make: Make) -> None:
    code = "import time\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n'finished'"
    r = await make(limits=Limits(cpu_seconds=2, wall_seconds=40)).run(code)
    assert r.limits_hit == ("cpu",)
    assert r.signal_name in ("SIGXCPU", "SIGKILL")
    assert r.return_value is None and not r.ok
    assert r.duration_s < 15, r.duration_s  # well before the loop's own 20 s (2 CPU s; a loaded machine stretches it)


async def test_one_long_c_level_operation_is_killed_by_the_cpu_limit(make: Make) -> None:
    """smolagents' interpreter let one big-integer power run 19.6 s past a 2 s timeout."""
    r = await make(limits=Limits(cpu_seconds=2, wall_seconds=40)).run("x = 7 ** (10 ** 8)\n'finished'")
    assert r.limits_hit == ("cpu",) and r.duration_s < 15


async def test_the_wall_limit_kills_a_sleeping_run(make: Make) -> None:
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)"
    started = time.monotonic()
    r = await make().run(code, timeout=1.5)
    assert r.limits_hit == ("wall",)
    assert r.signal_name == "SIGKILL" and r.exit_code is None
    assert 1.4 < r.duration_s < 4 and time.monotonic() - started < 6
    # the forked sleeper died too (checked by the autouse fixture)


async def test_a_file_beyond_the_size_limit_is_cut_and_reported(make: Make) -> None:
    r = await make(limits=Limits(file_size_bytes=1024 * 1024)).run(
        "with open('big.bin', 'wb') as fh:\n    fh.write(b'x' * (2 * 1024 * 1024))")
    assert r.error is not None and r.error.type == "OSError" and "File too large" in r.error.message
    assert r.limits_hit == ("file_size",)
    assert [(f.path, f.size) for f in r.files] == [("big.bin", 1024 * 1024)]


# -- positive checks --------------------------------------------------------------------------------
def squares_of_primes(n: int) -> int:
    primes: list[int] = []
    k = 2
    while len(primes) < n:
        if all(k % p for p in primes):
            primes.append(k)
        k += 1
    return sum(p * p for p in primes)


async def test_a_computation_returns_the_right_value(make: Make) -> None:
    sb = make()
    code = """
primes = []
k = 2
while len(primes) < 137:
    if all(k % p for p in primes):
        primes.append(k)
    k += 1
sum(p * p for p in primes)
"""
    r = await sb.run(code)
    assert r.ok and r.return_value == squares_of_primes(137) and r.return_repr == str(squares_of_primes(137))
    r = await sb.run("result = {'mean': sum([1, 2, 3, 4]) / 4, 'items': (1, 'two')}\nx = 5")
    assert r.return_value == {"mean": 2.5, "items": [1, "two"]}  # no trailing expression: `result`
    r = await sb.run("{1, 2}")
    assert r.return_value is None and r.return_repr == "{1, 2}"  # not JSON: the repr stands for it
    r = await sb.run("x = 1")
    assert r.ok and r.return_value is None and r.return_repr is None


async def test_files_written_in_the_work_dir_are_reported(make: Make) -> None:
    code = """
import os
open("in.txt", "a").write("+more")
os.makedirs("out/deep")
open("out/deep/new.bin", "wb").write(bytes(range(256)))
os.remove("gone.txt")
os.symlink("/etc/hostname", "link")
open("same.txt", "w").write("same")
sorted(os.listdir("."))
"""
    r = await make().run(code, files={"in.txt": "data", "gone.txt": b"bye", "same.txt": "same"})
    assert r.ok, r
    assert r.return_value == ["in.txt", "link", "out", "same.txt"]
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert r.files == (
        FileChange("gone.txt", "deleted", "file"),
        FileChange("in.txt", "modified", "file", 9, sha(b"data+more")),
        FileChange("link", "created", "symlink", len("/etc/hostname"), None),
        FileChange("out/deep/new.bin", "created", "file", 256, sha(bytes(range(256)))),
    )


async def test_stdout_and_stderr_are_captured_and_capped(make: Make) -> None:
    sb = make(limits=Limits(output_bytes=4096))
    r = await sb.run("import sys\nprint('a' * 200_000)\nsys.stderr.write('warn\\n')\n'done'")
    assert r.ok and r.return_value == "done"
    assert r.stdout == "a" * 4096 and r.stdout_bytes == 200_001
    assert r.stderr == "warn\n" and r.stderr_bytes == 5
    assert r.limits_hit == ("output",)
    r = await sb.run("print('héllo ✓')")
    assert r.stdout == "héllo ✓\n" and r.limits_hit == ()
    r = await sb.run("'y' * 10_000")  # a return value beyond the cap: its repr is cut, the JSON dropped
    assert r.ok and r.return_value is None and r.return_repr == "'" + "y" * 4095 and r.limits_hit == ("output",)


async def test_a_syntax_error_is_a_clear_result(make: Make) -> None:
    r = await make().run("x = 1\ndef f(:\n    pass\n")
    assert not r.ok and r.exit_code == 1
    assert r.error is not None and r.error.type == "SyntaxError" and r.error.line == 2
    assert "SyntaxError" in r.stderr and 'File "<code>", line 2' in r.error.traceback


async def test_an_exception_names_the_codes_own_line(make: Make) -> None:
    r = await make().run("def f(x):\n    return 1 / x\n\nprint('before')\nf(0)")
    assert r.stdout == "before\n" and r.exit_code == 1
    assert r.error is not None and (r.error.type, r.error.message, r.error.line) == (
        "ZeroDivisionError", "division by zero", 2)
    assert "_runner" not in r.error.traceback and "<code>" in r.error.traceback
    r = await make().run("import sys\nprint('bye')\nsys.exit(3)")
    assert r.exit_code == 3 and r.error is None and not r.ok


async def test_each_call_gets_a_fresh_work_dir_that_is_removed(make: Make, reachable_dir: Path) -> None:
    root = reachable_dir / "wd"
    root.mkdir()
    root.chmod(0o755)
    sb = make(workdir_root=root)
    r1 = await sb.run("import os\nopen('a', 'w').write('1')\nos.getcwd()")
    r2 = await sb.run("import os\nsorted(os.listdir('.'))")
    assert r2.return_value == [] and list(root.iterdir()) == []
    kept = make(workdir_root=root, keep_workdir=True)
    r3 = await kept.run("open('a', 'w').write('1')")
    assert r3.workdir is not None and Path(r3.workdir, "a").read_text() == "1"
    assert r1.workdir is None
    r4 = await kept.run(f"""
try:
    open({str(Path(r3.workdir, "a"))!r}, "w").write("changed by a later run")
    out = "WRITTEN"
except OSError as exc:
    out = type(exc).__name__
out
""")
    assert r4.return_value in ("PermissionError", "FileNotFoundError")  # a kept work dir is the caller's now
    assert Path(r3.workdir, "a").read_text() == "1"


async def test_cancelling_a_run_kills_it_and_cleans_up(make: Make, reachable_dir: Path) -> None:
    root = reachable_dir / "wd"
    root.mkdir()
    root.chmod(0o755)
    sb = make(workdir_root=root)
    await sb.start()  # the self-test's processes are gone before the run starts

    def running() -> int:
        return sum(len(processes_of(u)) for u in sb.uids)

    task = asyncio.ensure_future(sb.run("import os, time\nos.fork()\ntime.sleep(60)", timeout=60))
    deadline = time.monotonic() + 10
    while running() < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # until the code has forked
    assert running() >= 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(processes_of(u) for u in sb.uids)
    assert list(root.iterdir()) == []
    assert not BUSY_UIDS & set(sb.uids)  # the uid went back to the pool
    r = await sb.run("1 + 1")
    assert r.return_value == 2


async def test_concurrent_runs_never_share_a_uid(make: Make) -> None:
    """Two sandbox objects on the same two uids, five runs each at once: each run reports its uid and
    the uids of every process it saw, and no two overlapping runs had one uid."""
    pool = UIDS[:2] if isinstance(make(), BubblewrapSandbox) else UIDS[4:6]  # two of the fixture's pool
    a, b = make(uids=pool), make(uids=pool)
    code = "import os, time\nstart = time.time()\ntime.sleep(0.3)\n[os.getuid(), start, time.time()]"
    results = await asyncio.gather(*(sb.run(code) for sb in (a, b) * 5))
    spans = [r.return_value for r in results]
    assert {uid for uid, _, _ in spans} == set(pool)
    for i, (uid, s1, e1) in enumerate(spans):
        for uid2, s2, e2 in spans[i + 1:]:
            assert uid != uid2 or e1 <= s2 or e2 <= s1, "two runs at once on one uid"


# -- what holds, and refusing --------------------------------------------------------------------------
async def test_guarantees_are_measured_and_reported(make: Make, kind: str) -> None:
    g = await make().start()
    assert g.sandbox == kind
    designed = set(BubblewrapSandbox.DESIGNED if kind == "bubblewrap" else SubprocessSandbox.DESIGNED)
    if kind == "subprocess" and g.details["landlock_abi"] >= 1:
        designed |= {"filesystem_readonly", "secrets_invisible"}  # Landlock gives these too
    assert set(g.holding()) == designed, g.reasons
    assert set(g.not_holding()) == set(GUARANTEE_NAMES) - designed
    for name in g.not_holding():
        assert g.reasons[name]  # each False says why
    for name in g.holding():
        assert g.mechanisms[name]
    facts = g.details["self_test"]
    assert facts["uid"] in UIDS and facts["cap_eff"] == "0000000000000000" and facts["seccomp"] == "2"
    assert facts["rlimits"]["RLIMIT_NPROC"][0] == Limits().processes


async def test_a_required_guarantee_that_does_not_hold_refuses_to_run(kind: str) -> None:
    from .conftest import build

    sb = build(kind, required=("secrets_invisible", "disk_quota"))
    with pytest.raises(GuaranteeNotHeldError) as info:
        await sb.run("1")
    assert isinstance(info.value, ConfigurationError)
    assert "disk_quota" in info.value.missing and "required=" in str(info.value)


def test_bad_input_is_a_clear_typed_error() -> None:
    with pytest.raises(SandboxInputError, match="memory_bytes must be at least"):
        Limits(memory_bytes=1000)
    with pytest.raises(SandboxInputError, match="cpu_seconds must be a whole number"):
        Limits(cpu_seconds=1.5)  # type: ignore[arg-type]
    with pytest.raises(SandboxInputError, match="uids must be distinct"):
        SubprocessSandbox(uids=[5000, 5000])
    with pytest.raises(SandboxInputError, match="unknown guarantee"):
        SubprocessSandbox(required=["network"])
    assert issubclass(SandboxInputError, UserError) and issubclass(SandboxInputError, ValueError)


async def test_bad_run_arguments_are_refused_before_anything_runs(make: Make) -> None:
    sb = make()
    with pytest.raises(SandboxInputError, match="relative path inside the work dir"):
        await sb.run("1", files={"../escape.txt": "x"})
    with pytest.raises(SandboxInputError, match="relative path"):
        await sb.run("1", files={"/etc/passwd": "x"})
    with pytest.raises(SandboxInputError, match="code must be a str"):
        await sb.run(b"1")  # type: ignore[arg-type]
    with pytest.raises(SandboxInputError, match="timeout must be a finite positive"):
        await sb.run("1", timeout=0)
    with pytest.raises(SandboxInputError, match="'a/b' cannot be written into the work dir: File exists"):
        await sb.run("1", files={"a": "x", "a/b": "y"})
