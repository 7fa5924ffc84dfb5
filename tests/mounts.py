"""Mounting a small tmpfs for the real full-disk tests (shared by the store and fault suites)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def mount_or_skip(*args: str) -> None:
    """Run mount(8); skip, naming what is missing, when this machine does not allow it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root, and these tests do not run as root")
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not installed")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here: {done.stderr.strip()}")


def umount(path: Path) -> None:
    """Unmount ``path`` lazily (ignores a path that is not mounted)."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
