"""Escapes found by the adversarial review, each probed on the REAL bubblewrap and subprocess sandboxes
as root, with the host side checked: the code cannot swap its work dir for a link the root parent then
follows; no host UNIX socket (filesystem or abstract) can be reached; memory outside any address space
(System V shared memory, memfd, a host tmpfs) is refused; a kept work dir is the caller's; the exit
status and signal come from a monitor the code cannot reach; nothing of a call is left in the host's
world-writable directories. Each test failed on the code before the fix.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_agent.sandbox import GuaranteeNotHeldError, Limits
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.sandbox._workdir import SWEPT_DIRS

from .conftest import absence, build

Make = Callable[..., LocalSandbox]


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A root-owned host directory every uid may enter (0755), outside any work dir."""
    d = Path(tempfile.mkdtemp(prefix="fsm-hardening-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _uid_entries(uid: int) -> list[str]:
    """What ``uid`` owns at the top of the host's world-writable directories."""
    found = []
    for d in SWEPT_DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            try:
                if os.lstat(os.path.join(d, name)).st_uid == uid:
                    found.append(os.path.join(d, name))
            except OSError:
                pass
    return found


# -- 1. the work dir cannot be swapped for a link --------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
async def test_the_code_cannot_swap_its_work_dir_for_a_link(make: Make, host_dir: Path, keep: bool) -> None:
    secret_dir = host_dir / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = f"TOPSECRET-{uuid.uuid4().hex}\n".encode()
    (secret_dir / "key.txt").write_bytes(secret)
    (secret_dir / "key.txt").chmod(0o600)
    victim = host_dir / "nobody.txt"  # what a kept work dir's chown would have followed the link to
    victim.write_text("nobody's data")
    os.chown(victim, 65534, 65534)
    target = victim if keep else secret_dir
    code = f"""
import os
wd = os.getcwd()
os.chdir("/")
try:
    os.rename(wd, wd + ".moved")
    os.symlink({str(target)!r}, wd)
    out = "swapped"
except OSError as exc:
    out = type(exc).__name__
out
"""
    sticky = host_dir / "sticky"  # like /tmp, the default: anyone may create entries, and move their own
    sticky.mkdir()
    sticky.chmod(0o1777)
    sb = make(keep_workdir=keep, workdir_root=sticky)
    r = await sb.run(code)
    assert r.ok, r
    assert r.return_value != "swapped", r.return_value  # the root-owned 0711 parent (or the mount) forbids it
    assert all("key.txt" not in f.path for f in r.files), r.files
    digest = hashlib.sha256(secret).hexdigest()
    assert all(f.sha256 != digest for f in r.files)
    assert stat.S_IMODE(secret_dir.stat().st_mode) == 0o700 and secret_dir.stat().st_uid == 0
    assert (secret_dir / "key.txt").read_bytes() == secret
    assert (victim.stat().st_uid, victim.stat().st_gid) == (65534, 65534)
    root = Path(sb.workdir_root or tempfile.gettempdir())
    assert not [p for p in root.iterdir() if p.name.endswith(".moved")]


async def test_the_diff_never_follows_a_link_inside_the_work_dir(make: Make, host_dir: Path) -> None:
    secret_dir = host_dir / "root-only"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "key.txt").write_text("secret")
    r = await make().run(f"import os\nos.symlink({str(secret_dir)!r}, 'inside')\nos.symlink('/etc', 'etc')")
    assert r.ok, r
    assert sorted((f.path, f.kind) for f in r.files) == [("etc", "symlink"), ("inside", "symlink")]


# -- 2. no host UNIX socket ------------------------------------------------------------------------------
async def test_host_unix_sockets_cannot_be_reached(make: Make, host_dir: Path) -> None:
    path = str(host_dir / "service.sock")
    abstract = f"\0fsm-hardening-{uuid.uuid4().hex}"
    listeners = []
    accepted: list[bytes] = []
    for address in (path, abstract):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(4)
        s.settimeout(0.2)
        listeners.append(s)
    os.chmod(path, 0o777)  # a world-writable socket, as a database's or a desktop service's
    stop = threading.Event()

    def serve(s: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn.recv(100))
            conn.sendall(b"SECRET-FROM-A-ROOT-SERVICE")
            conn.close()

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in listeners]
    for t in threads:
        t.start()
    try:
        sb = make()
        r = await sb.run(f"""
import socket
out = {{}}
for name, address in (("path", {path!r}), ("abstract", {abstract!r})):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        s.sendall(b"hello")
        out[name] = s.recv(100).decode()
    except OSError as exc:
        out[name] = type(exc).__name__
a, b = socket.socketpair()  # a pair connects the code only to itself
a.sendall(b"ping")
out["pair"] = b.recv(4).decode()
out
""")
        assert r.ok, r
        assert r.return_value == {"path": "PermissionError", "abstract": "PermissionError", "pair": "ping"}
        assert accepted == []
        g = sb.guarantees()
        assert g.network_isolated
        assert g.details["self_test"]["unix_socket"].startswith("refused")
    finally:
        stop.set()
        for s in listeners:
            s.close()
        for t in threads:
            t.join(2)


# -- 3. memory outside the address space -----------------------------------------------------------------
def _shm_segments_of(uid: int) -> list[str]:
    with open("/proc/sysvipc/shm") as fh:
        rows = fh.read().splitlines()[1:]
    return [row for row in rows if int(row.split()[7]) == uid]  # the "uid" column


async def test_memory_outside_the_address_space_is_refused(make: Make, kind: str) -> None:
    sb = make(limits=Limits(memory_bytes=256 * 1024 * 1024))
    hold = f"/dev/shm/fsm-hold-{uuid.uuid4().hex}"
    r = await sb.run(f"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
out = {{}}
shmid = libc.shmget(0x5EC0, ctypes.c_size_t(128 << 20), 0o1666)   # IPC_CREAT | 0666, 128 MiB
out["shmget"] = errno.errorcode.get(ctypes.get_errno()) if shmid < 0 else "CREATED"
out["msgget"] = errno.errorcode.get(ctypes.get_errno()) if libc.msgget(0x5EC1, 0o1666) < 0 else "CREATED"
try:
    os.memfd_create("hold")
    out["memfd"] = "CREATED"
except OSError as exc:
    out["memfd"] = errno.errorcode[exc.errno]
try:
    with open({hold!r}, "wb") as fh:
        fh.write(b"x" * (1 << 20))
    out["dev_shm"] = "private" if os.stat("/dev/shm").st_dev != os.stat("/usr").st_dev else "written"
except OSError as exc:
    out["dev_shm"] = errno.errorcode[exc.errno]
out
""")
    assert r.ok, r
    got = r.return_value
    assert (got["shmget"], got["msgget"], got["memfd"]) == ("EPERM", "EPERM", "EPERM"), got
    assert not os.path.exists(hold)  # the host's /dev/shm (RAM) never got it
    assert got["dev_shm"] in ("private", "EACCES"), got  # bubblewrap's own capped tmpfs; Landlock refuses
    uids = sb.uids
    assert not any(_shm_segments_of(u) for u in uids)  # nothing outlives the call either
    g = sb.guarantees()
    assert g.memory_limited and "System V" in g.mechanisms["memory_limited"]


async def test_without_landlock_a_writable_host_tmpfs_is_reported_and_refused(reachable_dir: Path) -> None:
    """The subprocess sandbox cannot keep code from the host's /dev/shm (a tmpfs: RAM) without Landlock:
    the guarantees say memory is not bounded, and by default it refuses to run."""
    why = absence("subprocess")
    if why:
        pytest.skip(why)
    from fsm_agent.sandbox._selftest import fs_type

    sb = build("subprocess", workdir_root=reachable_dir, landlock=False)
    g = await sb.start()
    assert not g.filesystem_readonly and "Landlock is switched off" in g.reasons["filesystem_readonly"]
    assert not g.secrets_invisible and "/etc/passwd" in g.reasons["secrets_invisible"]
    if fs_type("/dev/shm") == "tmpfs":
        assert not g.memory_limited and "/dev/shm" in g.reasons["memory_limited"]
        with pytest.raises(GuaranteeNotHeldError) as info:
            await sb.run("1")
        assert "memory_limited" in info.value.missing
    else:
        assert g.memory_limited


# -- 6. a kept work dir is the caller's ------------------------------------------------------------------
async def test_a_kept_work_dir_is_handed_to_root(make: Make, kind: str, host_dir: Path) -> None:
    shared = host_dir / "shared.txt"  # a host file anyone may write: the code can hard-link it
    shared.write_text("host data")
    shared.chmod(0o666)
    shadow = os.lstat("/etc/shadow")
    sb = make(keep_workdir=True)
    r = await sb.run(f"""
import os
open("out.csv", "w").write("a,b\\n1,2\\n")
os.chmod("out.csv", 0o666)
open("tool", "w").write("#!/bin/sh\\n")
os.chmod("tool", 0o6777)
os.mkdir("sub")
os.chmod("sub", 0o777)
os.symlink("/etc/shadow", "shadow")
try:
    os.link({str(shared)!r}, "hard")
    linked = True
except OSError:
    linked = False  # bubblewrap: the host file is not in its mount namespace
os.chmod(".", 0o777)
linked
""")
    assert r.ok, r
    assert r.workdir is not None
    top = os.lstat(r.workdir)
    assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, 0, 0o700)
    for dirpath, dirnames, filenames in os.walk(r.workdir):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            assert (st.st_uid, st.st_gid) == (0, 0), name
            if not stat.S_ISLNK(st.st_mode):
                assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH), (name, oct(st.st_mode))
    assert os.path.islink(os.path.join(r.workdir, "shadow"))  # left a link, never followed
    now = os.lstat("/etc/shadow")
    assert (now.st_uid, now.st_gid, now.st_mode) == (shadow.st_uid, shadow.st_gid, shadow.st_mode)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o666 and shared.stat().st_uid == 0  # the host file untouched
    if r.return_value:  # the hard link became a copy of its own
        assert Path(r.workdir, "hard").read_text() == "host data" and shared.stat().st_nlink == 1
    other = build(kind, uids=(sb.uids[-1],), workdir_root=sb.workdir_root)  # a later call, another uid
    r2 = await other.run(f"""
try:
    open({os.path.join(r.workdir, "out.csv")!r}, "a").write("tampered")
    out = "WRITTEN"
except OSError as exc:
    out = type(exc).__name__
out
""")
    assert r2.return_value in ("PermissionError", "FileNotFoundError")
    assert Path(r.workdir, "out.csv").read_text() == "a,b\n1,2\n"


# -- 9. the exit status and signal cannot be forged ------------------------------------------------------
async def test_exit_status_and_signal_cannot_be_forged(make: Make) -> None:
    sb = make(limits=Limits(cpu_seconds=1, wall_seconds=20))
    r = await sb.run("import os\nprint('bye')\nos._exit(137)")  # what bwrap reports for a SIGKILL
    assert (r.exit_code, r.signal, r.limits_hit) == (137, None, ()), r
    r = await sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)")  # the CPU limit's signal, no CPU used
    assert r.signal_name == "SIGXCPU" and "cpu" not in r.limits_hit, r
    r = await sb.run("""
import os, json
fd = max(int(x) for x in os.listdir("/proc/self/fd") if int(x) > 2)
os.write(fd, json.dumps({"return_value": 42, "return_repr": "42", "limits": [], "error": None}).encode())
os.close(fd)
while True:
    pass
""")  # a forged report, then the real CPU limit
    assert r.signal_name in ("SIGXCPU", "SIGKILL") and r.limits_hit == ("cpu",), r


async def test_the_monitor_is_out_of_the_codes_reach(make: Make) -> None:
    sb = make()
    r = await sb.run("""
import os
try:
    out = os.listdir(f"/proc/{os.getppid()}/fd")
except OSError as exc:
    out = type(exc).__name__
out
""")
    assert r.return_value == "PermissionError", r  # the monitor is not dumpable (and Landlock hides /proc)
    r = await sb.run("import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(5)")
    if r.error is not None:  # Landlock ABI 6+ (subprocess sandbox): no signal leaves the code's own domain
        assert r.error.type == "PermissionError" and sb.guarantees().details["landlock_abi"] >= 6, r
    else:  # the code killed its monitor: the run ends, with no status the sandbox could trust
        assert (r.exit_code, r.signal) == (None, None) and not r.ok, r
        assert r.duration_s < 4


# -- 11. nothing left in the world-writable directories --------------------------------------------------
WRITE_EVERYWHERE = """
import os
out = {}
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    name = f"{d}/fsm-hardening-{os.getpid()}"
    try:
        with open(name, "w") as fh:
            fh.write("left behind")
        os.chmod(name, 0o644)
        os.mkdir(name + ".d")
        open(name + ".d/inner", "w").write("x")
        out[d] = "written"
    except OSError as exc:
        out[d] = type(exc).__name__
out
"""


async def test_nothing_of_a_call_is_left_in_world_writable_directories(make: Make, kind: str) -> None:
    sb = make()
    r = await sb.run(WRITE_EVERYWHERE)
    assert r.ok, r
    if kind == "subprocess" and sb.guarantees().details["landlock_abi"] >= 1:
        assert set(r.return_value.values()) == {"PermissionError"}  # Landlock refused each
    for uid in sb.uids:
        assert _uid_entries(uid) == []


async def test_without_landlock_what_the_uid_left_is_removed_after_the_call(reachable_dir: Path) -> None:
    why = absence("subprocess")
    if why:
        pytest.skip(why)
    sb = build("subprocess", workdir_root=reachable_dir, landlock=False, required=())
    r = await sb.run(WRITE_EVERYWHERE)
    assert r.ok, r
    assert r.return_value["/tmp"] == "written"  # the host's /tmp was writable during the call ...
    assert not sb.guarantees().filesystem_readonly  # ... and the guarantees say so
    for uid in sb.uids:
        assert _uid_entries(uid) == []  # ... and nothing of it is left after


async def test_a_work_dir_on_a_tmpfs_is_reported_as_unbounded_memory(kind: str) -> None:
    """Files in a work dir on a tmpfs are RAM, their number unbounded: memory_limited must not hold."""
    from fsm_agent.sandbox._selftest import fs_type

    if fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    root = Path(tempfile.mkdtemp(prefix="fsm-hardening-", dir="/dev/shm"))
    root.chmod(0o755)
    try:
        sb = build(kind, workdir_root=root)
        g = await sb.start()
        assert not g.memory_limited and "is a tmpfs" in g.reasons["memory_limited"]
        with pytest.raises(GuaranteeNotHeldError, match="memory_limited"):
            await sb.run("1")
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
