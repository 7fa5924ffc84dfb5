"""The program each sandboxed interpreter runs first (``python3 -I -c <this file's text> ...``).

It is trusted code that runs inside the sandbox before the model's code, as the sandbox's uid:

1. when asked (the subprocess sandbox, which has no ``bwrap --seccomp``), it loads the seccomp BPF
   program read from an inherited fd, after setting ``no_new_privs``;
2. it closes every inherited fd but stdio and the result pipe, and reads the code from stdin;
3. it forks: the parent stays a **monitor** (not dumpable, so the code, although it runs as the
   same uid, cannot open its ``/proc`` files or descriptors; ``ptrace`` and ``pidfd_getfd`` are
   refused by the seccomp filter) and alone holds the result pipe; the child waits until the
   monitor is no longer dumpable, then applies the Landlock
   rules when asked (the subprocess sandbox: writes only in the work dir, reads only under the
   given paths, no TCP, no abstract UNIX sockets or signals outside the run), notes failed
   ``fork``/thread starts (the ``processes`` limit) and runs the code as ``__main__``: the last
   top-level expression's value, else a top-level ``result``, is the return value; it writes its
   report (the return value, its ``repr``, the uncaught exception, the limits it saw fire) to a
   pipe to the monitor;
4. the monitor waits for the child (``wait4``) and writes to the result pipe: the child's real exit
   status or signal and the CPU seconds it used, which the code cannot forge, then the child's
   report (which the code can: it is the code's own process).

It never isolates anything by itself: the kernel does (namespaces, uid, seccomp, Landlock,
rlimits). It must run on any CPython 3.8+, standard library only; it is not imported by fsm_agent.

argv: ``RESULT_FD SECCOMP_FD VALUE_CAP OPTIONS`` (``SECCOMP_FD`` ``-1``: none; ``OPTIONS`` a JSON
object, ``{"landlock": {"ro": [...], "rw": [...], "dev_rw": [...], "dev_ro": [...]}}`` or ``{}``).

The result pipe carries ``S`` (the interpreter started) and, when the child ended, ``M``, one line
of JSON ``{"exit": N}`` or ``{"signal": N}`` with ``"cpu_s"``, a newline, and what came through the
report pipe: the child's report is the JSON object after its last ``REPORT`` byte (the code may have
written to that pipe before; the parent reads only the last report, and trusts none of it about the
``cpu``, ``wall`` or ``output`` limits). The report is ASCII JSON (``ensure_ascii``): a lone surrogate
in a text is escaped as ``\\udXXX`` before, and no text of it is larger than ``VALUE_CAP`` UTF-8
bytes (plus a short note where it was cut), so the whole report fits in :func:`report_budget`.
"""

from __future__ import annotations

# Only what the monitor needs is imported before the fork: every page the two processes share is
# copied when the child, exiting, touches it. The child imports what the report needs before the
# code runs (code that uses up its file descriptors or breaks the import system must not lose its
# report; the traceback module is imported only for an error, with a bare "Type: message" when it
# cannot be).
import errno
import os
import select
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional

STARTED = b"S"
"""Written to the result pipe first: the interpreter started (so a missing marker means the launcher
chain failed)."""
STATUS = b"M"
"""Written by the monitor before the child's status line."""
MAX_DEPTH = 200
"""A return value nested deeper than this is given by its ``repr`` only (JSON readers such as orjson
stop at 255 levels)."""
REPORT = b"\x1e"
"""Written before the child's report (JSON text never holds this byte)."""
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 64 - 1
"""Integers outside this range are not kept as JSON numbers (most JSON readers turn them into
floats, losing digits): the value is then given by its exact ``repr`` only."""


def report_budget(cap: int) -> int:
    """Bytes of the report pipe the monitor keeps: the value (at most ``cap`` bytes of compact UTF-8
    JSON, at most 3 times that as the report's ASCII JSON), its ``repr``, the error's message and
    traceback (each at most ``cap`` UTF-8 bytes and a note; at most 6 bytes of ASCII JSON per byte, a
    control character's ``\\u0001``), and room for the rest. The parent keeps the same
    (``fsm_agent.sandbox._report``)."""
    return 24 * cap + 65536


_hit: "set[str]" = set()
_write, _close = os.write, os.close
_dumps: "Callable[..., str]"  # json.dumps and json.loads as the child imported them, before the code ran
_loads: "Callable[..., Any]"
_surrogates: "Callable[..., str]"  # a compiled pattern's sub, bound before the code ran


def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


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
    libc = _libc()
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit(f"fsm-agent sandbox: PR_SET_NO_NEW_PRIVS failed: errno {ctypes.get_errno()}")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise SystemExit(f"fsm-agent sandbox: loading the seccomp filter failed: errno {ctypes.get_errno()}")


# Landlock (linux/landlock.h): system calls 444-446 on every architecture.
_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 14, 1 << 15
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV


def _landlock(spec: Dict[str, List[str]]) -> int:
    """Restrict this process and its descendants to ``spec`` (Landlock); return the ABI version
    applied, or 0 when the kernel has no Landlock (the sandbox's self-test measures what holds)."""
    import ctypes
    import struct

    libc = _libc()
    abi = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._VERSION
    if abi < 1:
        return 0
    fs = (1 << 13) - 1  # ABI 1: execute .. make_sym
    if abi >= 2:
        fs |= 1 << 13  # refer
    if abi >= 3:
        fs |= _FS_TRUNCATE
    if abi >= 5:
        fs |= _FS_IOCTL_DEV
    net = 3 if abi >= 4 else 0  # bind_tcp | connect_tcp, with no rule: refused
    scoped = 3 if abi >= 6 else 0  # abstract UNIX sockets and signals stay inside the run
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(_LL_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    read_only = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    device_rw = _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
    for key, access in (("ro", read_only), ("rw", fs), ("dev_rw", device_rw), ("dev_ro", _FS_READ_FILE)):
        for path in spec.get(key) or ():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent here: nothing to allow
            try:
                rights = access & fs
                if not os.path.isdir(f"/proc/self/fd/{fd}"):
                    rights &= _FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                libc.syscall(_LL_ADD, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0))
            finally:
                os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (setpriv --nnp set it already)
        os.close(ruleset)
        return 0
    done = libc.syscall(_LL_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    os.close(ruleset)
    return int(abi) if done == 0 else 0


def _set_dumpable(flag: int) -> None:
    try:
        _libc().prctl(4, flag, 0, 0, 0)  # PR_SET_DUMPABLE
    except OSError:
        pass


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
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file_size"
    if _eagain(exc) or _no_thread(exc):
        return "processes"
    return None


def _plain(value: Any) -> bool:
    """``value`` (decoded JSON) nests at most MAX_DEPTH deep and every integer fits in 64 bits."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, bool) or item is None or isinstance(item, (str, float)):
            continue
        if isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                return False
            continue
        if depth >= MAX_DEPTH:
            return False
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return True


def _jsonable(value: Any, cap: int) -> Dict[str, Any]:
    """The report's ``return_repr`` (escaped; longer than ``cap`` bytes when the ``repr`` is, so the
    parent sees that it cuts it) and ``return_value`` (when its JSON fits in ``cap`` bytes, nests at
    most MAX_DEPTH deep and every integer fits in 64 bits)."""
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # the exact digits of any integer (cut below), as the model needs them
    try:
        text = repr(value)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned a non-string")
    except BaseException as exc:  # noqa: BLE001 - a broken __repr__ must not lose the run
        text = f"<{type(value).__name__} object; repr() failed: {type(exc).__name__}>"
    data = _escaped(text).encode("utf-8")
    out: Dict[str, Any] = {"return_repr": data[: cap + 4].decode("utf-8", "ignore")}
    try:
        encoded = _dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except BaseException:  # noqa: BLE001 - not JSON: the repr stands for it
        return out
    if len(encoded.encode("utf-8", "surrogatepass")) > cap:
        return out
    try:
        decoded = _loads(encoded)
    except BaseException:  # noqa: BLE001 - too deep to read back
        return out
    if _plain(decoded):
        out["return_value"] = decoded
    return out


def _escaped(text: str) -> str:
    """``text`` as the parent carries it (``fsm_agent.sandbox.base.escaped_text``): a lone surrogate
    standing for a byte that was not UTF-8 (``os.fsdecode(b"\\xff")``) as ``\\xff``, any other as
    ``\\ud800``."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _surrogates(_escape_one, text)


def _escape_one(match: Any) -> str:
    code = ord(match.group())
    return "\\x%02x" % (code - 0xDC00) if 0xDC80 <= code <= 0xDCFF else "\\u%04x" % code


def _cut(text: str, cap: int, keep_end: bool = False) -> str:
    """``text`` escaped (:func:`_escaped`), cut to ``cap`` UTF-8 bytes with a note saying how much."""
    text = _escaped(text)
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text
    kept = (data[-cap:] if keep_end else data[:cap]).decode("utf-8", "ignore")
    note = f"[{len(text) - len(kept)} characters cut]"
    return note + kept if keep_end else kept + note


def _error(exc: BaseException, source: str, cap: int) -> Dict[str, Any]:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next  # drop the runner's own frames
    try:
        import linecache
        import traceback

        linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:  # noqa: BLE001 - no file descriptor left to import with, or a broken __str__
        text = f"{type(exc).__name__}: <the traceback could not be formatted>\n"
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
    return {"type": _cut(type(exc).__name__, 200), "message": _cut(message, cap),
            "traceback": _cut(text, cap, keep_end=True), "line": line if type(line) is int else None}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_write(fd, view):]


def _run_code(source: str, report_fd: int, cap: int) -> int:
    """The child: run the code, write the report to ``report_fd``, return the exit status."""
    import ast
    import builtins
    import types

    sys.argv = ["<code>"]
    sys.dont_write_bytecode = True  # no __pycache__ among the files the run changed
    sys.path.insert(0, os.getcwd())  # -I leaves the work dir off the path; the code's own modules live there
    _install_watches()
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
            try:
                print(_cut(str(code), cap), file=sys.stderr)
            except BaseException:  # noqa: BLE001
                pass
    except BaseException as exc:  # noqa: BLE001 - everything the code raised is the model's information
        report["error"] = _error(exc, source, cap)
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
    data = _encode(report)
    try:
        _write_all(report_fd, REPORT + data)
        _close(report_fd)
    except OSError:
        pass
    return status


def _encode(report: Dict[str, Any]) -> bytes:
    """The report as ASCII JSON; when the code broke the encoder (or memory ran out), the report
    without its return value, then the error's type and message and the limits, then the limits."""
    smaller = {k: v for k, v in report.items() if k not in ("return_value", "return_repr")}
    error = report.get("error") or {}
    for attempt in (report, smaller, {"error": {"type": error.get("type"), "message": error.get("message")},
                                      "limits": sorted(_hit)} if error else None):
        if attempt is None:
            continue
        try:
            return _dumps(attempt).encode("ascii")
        except BaseException:  # noqa: BLE001
            continue
    return ('{"limits": [%s]}' % ", ".join('"%s"' % name for name in sorted(_hit))).encode()


def _monitor(pid: int, report_r: int, result_fd: int, keep: int) -> None:
    """The parent: read the child's report, wait for the child, write its true status and the report."""
    kept = bytearray()
    waited = None
    while waited is None:
        ready, _, _ = select.select([report_r], [], [], 0.05)
        if ready:
            chunk = os.read(report_r, 65536)
            if not chunk:
                break  # the child closed its end (its report is complete)
            if len(kept) < keep:
                kept += chunk[: keep - len(kept)]
            continue
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:  # the child ended while a process it forked still holds the report pipe open
            waited = (status, usage)
            os.set_blocking(report_r, False)
            try:
                while len(kept) < keep:
                    chunk = os.read(report_r, 65536)
                    if not chunk:
                        break
                    kept += chunk[: keep - len(kept)]
            except BlockingIOError:
                pass
    if waited is None:
        _, status, usage = os.wait4(pid, 0)
        waited = (status, usage)
    status, usage = waited
    how = f'"signal": {os.WTERMSIG(status)}' if os.WIFSIGNALED(status) else f'"exit": {os.WEXITSTATUS(status)}'
    line = '{"cpu_s": %.3f, %s}\n' % (usage.ru_utime + usage.ru_stime, how)
    try:
        _write_all(result_fd, STATUS + line.encode() + bytes(kept))
    except OSError:
        pass


def main(argv: List[str]) -> int:
    result_fd, seccomp_fd, cap = int(argv[0]), int(argv[1]), int(argv[2])
    if seccomp_fd >= 0:
        _load_seccomp(seccomp_fd)  # before the fork: the monitor is filtered too
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
    report_r, report_w = os.pipe()  # both close-on-exec: a program the code execs never holds them
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(result_fd)
        os.close(go_w)
        return _child(argv[3] if len(argv) > 3 else "{}", report_w, go_r, cap)
    os.close(report_w)
    os.close(go_r)
    _set_dumpable(0)  # from now on the code's uid cannot open the monitor's /proc files or descriptors
    os.write(go_w, b"g")  # only then may the code run
    os.close(go_w)
    _monitor(pid, report_r, result_fd, report_budget(cap))
    os._exit(0)


def _child(options: str, report_w: int, go_r: int, cap: int) -> int:
    global _dumps, _loads, _surrogates
    import json
    import re

    _dumps, _loads = json.dumps, json.loads  # the code may replace json.dumps; the report must not use its version
    _surrogates = re.compile("[\ud800-\udfff]").sub
    spec = _loads(options)
    source = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.register_at_fork(after_in_child=lambda: _close_quietly(report_w))  # the code's own forks
    os.read(go_r, 1)  # the monitor is not dumpable any more (or it died: then this run ends anyway)
    os.close(go_r)
    landlock = spec.get("landlock")
    if landlock:
        _landlock(landlock)
    return _run_code(source, report_w, cap)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
