"""Fixtures of the sandbox tests: real sandboxes on dedicated uids of this test process.

Each test process takes its own block of uids (from the pid), so two test runs on one machine never
share a uid: the subprocess sandbox kills every process of its uid after each run, and
``RLIMIT_NPROC`` counts them all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_agent.sandbox import BubblewrapSandbox, SubprocessSandbox
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.sandbox._uids import processes_of

KINDS = ("bubblewrap", "subprocess")
UIDS = range(2_100_100_000 + (os.getpid() % 50_000) * 8, 2_100_100_000 + (os.getpid() % 50_000) * 8 + 8)
"""This test process's dedicated uids (8)."""


def absence(kind: str) -> str | None:
    """Why ``kind`` cannot be tested here (a named real absence), or ``None``."""
    if os.geteuid() != 0:
        return "not root: the probes check the drop to a dedicated uid, which needs root (CI runs as root)"
    if not shutil.which("setpriv") or not shutil.which("prlimit"):
        return "util-linux's setpriv/prlimit are not installed"
    if kind == "bubblewrap" and not shutil.which("bwrap"):
        return "bwrap is not installed (apt-get install bubblewrap)"
    return None


NON_ROOT_UID = UIDS[-1]
"""The uid tests/sandbox/test_not_root.py runs a whole fsm_agent process as (in no sandbox's pool)."""


def build(kind: str, **options: Any) -> LocalSandbox:
    options.setdefault("uids", UIDS[:4] if kind == "bubblewrap" else UIDS[4:7])
    cls = BubblewrapSandbox if kind == "bubblewrap" else SubprocessSandbox
    return cls(**options)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    why = absence(request.param)
    if why:
        pytest.skip(why)
    return str(request.param)


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A fresh directory the sandbox uids can reach (0755 under /tmp; pytest's own tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="fsm-sandbox-test-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make(kind: str, reachable_dir: Path) -> Callable[..., LocalSandbox]:
    """``make(**options)``: a sandbox of this test's kind, its work dirs in a fresh directory."""
    root = reachable_dir / "workdirs"
    root.mkdir()
    root.chmod(0o755)

    def factory(**options: Any) -> LocalSandbox:
        options.setdefault("workdir_root", root)
        return build(kind, **options)

    return factory


@pytest.fixture(autouse=True)
def _nothing_left_running() -> Any:
    """After every test: no process runs as any of this test process's dedicated uids."""
    yield
    left = {uid: processes_of(uid) for uid in UIDS}
    assert not any(left.values()), f"processes left running as the sandbox uids: {left}"
