"""The program each sandboxed interpreter runs first (``python3 -I -c <this file's text> ...``).

It is trusted code that runs inside the sandbox before the model's code, as the sandbox's uid:

1. when asked (the subprocess sandbox, which has no ``bwrap --seccomp``), it loads the seccomp BPF
   program read from an inherited fd, after setting ``no_new_privs``;
2. it closes every inherited fd but stdio and the result pipe, and reads the code from stdin;
3. it notes failed ``fork``/thread starts (the ``processes`` limit) and runs the code as
   ``__main__``: the last top-level expression's value, else a top-level ``result``, is the
   return value;
4. it writes one JSON document to the result pipe: the return value, its ``repr``, the uncaught
   exception, the limits it saw fire.

It never isolates anything by itself: the kernel does (namespaces, uid, seccomp, rlimits). It must
run on any CPython 3.8+, standard library only; it is not imported by fsm_agent.

argv: ``RESULT_FD SECCOMP_FD VALUE_CAP`` (``SECCOMP_FD`` ``-1``: none).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional

STARTED = b"S"
"""Written to the result pipe first: the interpreter started (so a missing marker means the launcher
chain failed)."""

_hit: set[str] = set()


def _load_seccomp(fd: int) -> None:
    import ctypes

    data = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    if not data or len(data) % 8:
        raise SystemExit("fsm-agent sandbox: the seccomp program is empty or malformed")

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    n = len(data) // 8
    program = (SockFilter * n).from_buffer_copy(data)
    prog = SockFprog(n, ctypes.cast(program, ctypes.POINTER(SockFilter)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit(f"fsm-agent sandbox: PR_SET_NO_NEW_PRIVS failed: errno {ctypes.get_errno()}")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise SystemExit(f"fsm-agent sandbox: loading the seccomp filter failed: errno {ctypes.get_errno()}")


def _watch(owner: Any, name: str, limit: str, match: Callable[[BaseException], bool]) -> None:
    """Wrap ``owner.name`` so that a failure ``match`` accepts is noted as ``limit`` (then re-raised)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if match(exc):
                _hit.add(limit)
            raise

    setattr(owner, name, wrapper)


def _eagain(exc: BaseException) -> bool:
    import errno

    return isinstance(exc, OSError) and exc.errno == errno.EAGAIN


def _no_thread(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)


def _install_watches() -> None:
    import _posixsubprocess
    import _thread

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        _watch(os, name, "processes", _eagain)
    _watch(_posixsubprocess, "fork_exec", "processes", _eagain)
    _watch(_thread, "start_new_thread", "processes", _no_thread)
    threading = sys.modules.get("threading")
    if threading is not None:
        _watch(threading, "_start_new_thread", "processes", _no_thread)


def _limit_of(exc: BaseException) -> Optional[str]:
    import errno

    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file_size"
    if _eagain(exc) or _no_thread(exc):
        return "processes"
    return None


def _jsonable(value: Any, cap: int) -> Dict[str, Any]:
    import json

    try:
        text = repr(value)
    except BaseException as exc:  # noqa: BLE001 - a broken __repr__ must not lose the run
        text = f"<{type(value).__name__} object; repr() failed: {type(exc).__name__}: {exc}>"
    out: Dict[str, Any] = {"return_repr": text[:cap], "repr_truncated": len(text) > cap}
    try:
        encoded = json.dumps(value, allow_nan=False)
    except BaseException:  # noqa: BLE001 - not JSON: the repr stands for it
        return out
    if len(encoded.encode("utf-8", "replace")) > cap:
        out["value_truncated"] = True
        return out
    out["return_value"] = json.loads(encoded)
    return out


def _error(exc: BaseException, source: str) -> Dict[str, Any]:
    import linecache
    import traceback

    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next  # drop the runner's own frames
    lines = traceback.format_exception(type(exc), exc, tb)
    line: Optional[int] = None
    if isinstance(exc, SyntaxError):
        line = exc.lineno
    else:
        walk = tb
        while walk is not None:
            if walk.tb_frame.f_code.co_filename == "<code>":
                line = walk.tb_lineno
            walk = walk.tb_next
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001
        message = "<str() failed>"
    return {"type": type(exc).__name__, "message": message, "traceback": "".join(lines), "line": line}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv: List[str]) -> int:
    result_fd, seccomp_fd, cap = int(argv[0]), int(argv[1]), int(argv[2])
    if seccomp_fd >= 0:
        _load_seccomp(seccomp_fd)
    keep = {0, 1, 2, result_fd}
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    os.set_inheritable(result_fd, False)
    os.write(result_fd, STARTED)
    source = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.argv = ["<code>"]
    sys.dont_write_bytecode = True  # no __pycache__ among the files the run changed
    sys.path.insert(0, os.getcwd())  # -I leaves the work dir off the path; the code's own modules live there
    _install_watches()

    import ast
    import builtins

    import types

    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module  # the code's functions pickle as __main__.*; the runner keeps its own globals
    namespace = module.__dict__
    report: Dict[str, Any] = {}
    status = 0
    try:
        tree = ast.parse(source, "<code>")  # parsing only, to find the last expression; never to isolate
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        body = compile(tree, "<code>", "exec")
        tail = compile(last, "<code>", "eval") if last is not None else None
        exec(body, namespace)  # noqa: S102 - the sandbox confines it
        if tail is not None:
            value = eval(tail, namespace)  # noqa: S307
            report.update(_jsonable(value, cap))
        elif "result" in namespace:
            report.update(_jsonable(namespace["result"], cap))
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - everything the code raised is the model's information
        report["error"] = _error(exc, source)
        limit = _limit_of(exc)
        if limit:
            _hit.add(limit)
        try:
            sys.stderr.write(report["error"]["traceback"])
        except BaseException:  # noqa: BLE001
            pass
        status = 1
    report["limits"] = sorted(_hit)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken stream
            pass
    import json

    _write_all(result_fd, json.dumps(report).encode("utf-8", "replace"))
    os.close(result_fd)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
