"""Not root: a real fsm_agent process running as an ordinary uid cannot switch to a dedicated uid.

The test starts the system's ``python3`` as an unprivileged uid (``setpriv``) with this venv's
packages on its path, and that process builds the sandboxes itself. By default both refuse, naming
``uid_dropped`` and ``processes_limited`` and why; opted in (``required=()``), the code runs as the
caller's own uid, and the guarantees say what no longer holds while the rest (seccomp, namespaces,
rlimits) still does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator

import orjson
import pytest

from .conftest import NON_ROOT_UID, absence

HELPER = r'''
import asyncio, json, sys
from fsm_agent.sandbox import BubblewrapSandbox, GuaranteeNotHeldError, SubprocessSandbox

async def main():
    out = {}
    for cls in (SubprocessSandbox, BubblewrapSandbox):
        if cls is BubblewrapSandbox and not sys.argv[1] == "bwrap":
            continue
        doc = out[cls.NAME] = {}
        try:
            await cls(workdir_root="/tmp").run("1")
            doc["default"] = "ran"
        except GuaranteeNotHeldError as exc:
            doc["default"] = list(exc.missing)
            doc["message"] = str(exc)
        sb = cls(workdir_root="/tmp", required=())
        r = await sb.run("import os, socket\ntry:\n    socket.socket(socket.AF_INET)\n    net = 'open'\n"
                         "except OSError as exc:\n    net = type(exc).__name__\n[os.getuid(), net]")
        doc["opted_in"] = r.return_value
        doc["not_holding"] = list(sb.guarantees().not_holding())
        doc["landlock_abi"] = sb.guarantees().details.get("landlock_abi")
    print(json.dumps(out))

asyncio.run(main())
'''


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "not root: the test needs root to start a process as another uid"
    why = absence("subprocess")
    if why:
        return why
    system = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                            capture_output=True, text=True).stdout.strip()
    if system != str(tuple(sys.version_info[:2])):
        return (f"the system python3 is {system}, the venv's {tuple(sys.version_info[:2])}: its packages cannot be "
                "imported by a process of the system python3")
    return None


@contextlib.contextmanager
def _traversable(*paths: str) -> Iterator[None]:
    """Let any uid pass through the directories above ``paths`` for the block (``o+x``), and list
    ``paths`` themselves (``o+r``: they are import path entries), then put their modes back. A checkout and its venv often sit under a mode-700 directory (``/root``, a
    ``mktemp -d``), which the unprivileged uid could not enter to import fsm_agent."""
    changed: list[tuple[str, int]] = []
    try:
        for path in paths:
            parts = os.path.abspath(path).split(os.sep)
            for i in range(2, len(parts) + 1):
                d = os.sep.join(parts[:i])
                mode = stat.S_IMODE(os.stat(d).st_mode)
                # the paths themselves are import path entries: Python lists them (o+r), not only enters
                need = stat.S_IXOTH | (stat.S_IROTH if i == len(parts) else 0)
                if mode & need != need and all(d != c for c, _ in changed):
                    os.chmod(d, mode | need)
                    changed.append((d, mode))
        yield
    finally:
        for d, mode in reversed(changed):
            os.chmod(d, mode)


async def test_not_root_refuses_by_default_and_runs_as_your_uid_when_opted_in() -> None:
    why = _why_not()
    if why:
        pytest.skip(why)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    purelib = sysconfig.get_paths()["purelib"]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp", "PYTHONPATH": f"{repo}:{purelib}"}
    with _traversable(repo, purelib):
        proc = await asyncio.create_subprocess_exec(
            "setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}", "--clear-groups", "--",
            "/usr/bin/python3", "-c", HELPER, "bwrap" if shutil.which("bwrap") else "-",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    doc = orjson.loads(out)
    sub = doc["subprocess"]
    assert sub["default"] == ["uid_dropped", "processes_limited"]
    assert "not root: cannot switch to a dedicated uid" in sub["message"] and "required=" in sub["message"]
    assert sub["opted_in"] == [NON_ROOT_UID, "PermissionError"]  # your uid; the seccomp filter still holds
    if sub["landlock_abi"] >= 1:  # Landlock needs no privilege: the files stay closed to your own uid too
        assert sub["not_holding"] == ["uid_dropped", "processes_limited", "disk_quota"]
    else:  # (memory_limited too, when /dev/shm is a tmpfs)
        assert set(sub["not_holding"]) >= {"filesystem_readonly", "secrets_invisible", "uid_dropped",
                                           "processes_limited", "disk_quota"}
    if "bubblewrap" in doc:
        bw = doc["bubblewrap"]
        assert bw["default"] == ["uid_dropped", "processes_limited"]
        assert bw["opted_in"] == [NON_ROOT_UID, "PermissionError"]
        assert bw["not_holding"] == ["uid_dropped", "processes_limited", "disk_quota"]
