"""A sandbox call's work dir: made root-owned, looked at through descriptors, removed or handed to root.

Each call's work dir is ``ROOT/fsm-sandbox-<sandbox>-<hex>/work``: the outer directory is root's
(mode 0711), ``work`` inside it the call's uid's (mode 0700), so the code cannot rename its work dir
or put a link in its place. The seeded files are written before ``work`` is handed to the uid.
Every later look at it (:func:`snapshot`, :func:`hand_to_root`, :func:`remove`) goes through a
descriptor of the root-owned directory and never follows a link, and is bounded (entries, depth,
bytes hashed). :func:`sweep` removes what a uid left at the top of the world-writable directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from ._report import file_name
from .base import FileChange, SandboxError, SandboxInputError, SandboxUnavailableError

__all__ = ["Entry", "SWEPT_DIRS", "WORK", "check_root", "create", "diff", "hand_to_root", "new_path", "remove",
           "remove_leftover", "root_dir", "snapshot", "sweep", "sweep_extra"]

_MAX_ENTRIES = 10_000
_MAX_DEPTH = 64
_HASH_BUDGET = 256 * 1024 * 1024
WORK = "work"
"""The name of the uid's directory inside the root-owned outer one."""
_PREFIX = "fsm-sandbox-"
SWEPT_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
"""World-writable directories from which the uid's entries are removed after a call, when the sandbox
cannot keep the code from writing there (the subprocess sandbox without Landlock), and after a
crashed call."""

Entry = tuple[str, int, str | None]
"""(kind, size, sha256) of a work dir entry."""

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every directory of a work dir is opened: never through a link."""


def walk(top: int, max_entries: int = _MAX_ENTRIES) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """Every entry under the directory ``top`` (a descriptor) as (relative path, lstat, the
    descriptor of its directory, its name), depth first, streamed: never following a link, opening
    each directory relative to its parent's descriptor (``O_NOFOLLOW``), at most ``max_entries``
    entries and :data:`_MAX_DEPTH` levels. Raises :class:`_Truncated` (after the entries it yielded)
    when it stopped at a cap."""
    first = os.open(".", DIR_FLAGS, dir_fd=top)
    stack: list[tuple[str, int, Any]] = [("", first, os.scandir(first))]
    count = 0
    cut = False
    try:
        while stack:
            rel, fd, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                it.close()
                os.close(fd)
                stack.pop()
                continue
            count += 1
            if count > max_entries:
                cut = True
                break
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            yield path, st, fd, entry.name
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= _MAX_DEPTH:
                    cut = True
                    continue
                try:
                    sub = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    stack.append((path, sub, os.scandir(sub)))
                except OSError:
                    os.close(sub)
    finally:
        for _, fd, it in stack:
            it.close()
            with contextlib.suppress(OSError):
                os.close(fd)
    if cut:
        raise _Truncated


class _Truncated(Exception):
    pass


def _sha256(dir_fd: int, name: str, budget: list[int]) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                return None
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def snapshot(outer_fd: int) -> tuple[dict[str, Entry], bool]:
    """What the work dir (``work`` under the root-owned ``outer_fd``) holds, and whether the listing
    was cut at a cap."""
    out: dict[str, Entry] = {}
    budget = [_HASH_BUDGET]
    try:
        top = os.open(WORK, DIR_FLAGS, dir_fd=outer_fd)
    except OSError:
        return out, False
    try:
        for rel, st, dir_fd, name in walk(top):
            if stat.S_ISDIR(st.st_mode):
                continue
            path = file_name(rel)  # a name that is not UTF-8 is carried with \xNN escapes
            if stat.S_ISREG(st.st_mode):
                out[path] = ("file", st.st_size, _sha256(dir_fd, name, budget))
            elif stat.S_ISLNK(st.st_mode):
                out[path] = ("symlink", st.st_size, None)
            else:
                out[path] = ("other", st.st_size, None)
    except _Truncated:
        return out, True
    finally:
        os.close(top)
    return out, False


def diff(before: dict[str, Entry], after: dict[str, Entry]) -> list[FileChange]:
    """What changed between two :func:`snapshot` listings, by path."""
    changes = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if new is None:
            assert old is not None
            changes.append(FileChange(path, "deleted", old[0]))  # type: ignore[arg-type]
        elif old is None:
            changes.append(FileChange(path, "created", new[0], new[1], new[2]))  # type: ignore[arg-type]
        elif old != new:
            changes.append(FileChange(path, "modified", new[0], new[1], new[2]))  # type: ignore[arg-type]
    return changes


def remove(path: str) -> None:
    """Remove a tree without following links, streaming (the parent's memory does not grow with the
    number of entries); ``rm -rf`` for a tree deeper than :data:`_MAX_DEPTH` levels."""
    try:
        if _remove_tree(path):
            return
    except FileNotFoundError:
        return
    except OSError:
        pass
    rm = shutil.which("rm")
    if rm:
        subprocess.run([rm, "-rf", "--one-file-system", "--", path], check=False, capture_output=True)


def _remove_tree(path: str) -> bool:
    """Remove ``path`` through directory descriptors (``O_NOFOLLOW``; a link is removed, never
    followed); ``False`` when it is deeper than :data:`_MAX_DEPTH` levels (the rest is left)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    parent_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stack = [os.open(os.path.basename(path), DIR_FLAGS, dir_fd=parent_fd)]
    names = [os.path.basename(path)]
    try:
        while stack:
            fd = stack[-1]
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o700)  # code may have taken its own rights away (not root: they bind)
            sub = -1
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            sub = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                            names.append(entry.name)
                            break
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        continue
            if sub >= 0:
                stack.append(sub)
                if len(stack) > _MAX_DEPTH:
                    return False
                continue
            os.close(stack.pop())
            os.rmdir(names.pop(), dir_fd=stack[-1] if stack else parent_fd)
        return True
    finally:
        for fd in stack:
            os.close(fd)
        os.close(parent_fd)


def _copy_in_place(dir_fd: int, name: str) -> None:
    """Replace the hard-linked file ``name`` by a copy of its own (so that changing it never changes
    the other link's file)."""
    tmp = f".fsm-copy-{secrets.token_hex(6)}"
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            while chunk := os.read(src, 1 << 20):
                os.write(dst, chunk)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def hand_to_root(outer_fd: int) -> None:
    """A kept work dir becomes the caller's: every entry owned by root, no set-id bits, nothing
    writable by group or others, the top mode 0700 (so no later run, of any uid, reaches it). A
    regular file with more than one link is replaced by a copy first (the other link may be a host
    file the code could link to). Symlinks stay symlinks (never followed here; the caller must not
    follow them either)."""
    top = os.open(WORK, DIR_FLAGS, dir_fd=outer_fd)
    try:
        try:
            for _, st, dir_fd, name in walk(top, max_entries=10 * _MAX_ENTRIES):
                if stat.S_ISLNK(st.st_mode):
                    os.chown(name, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    _copy_in_place(dir_fd, name)
                # no process of the uid runs any more and no other uid can reach the tree: the entry
                # checked by lstat above is still what the name holds
                os.chown(name, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)
                os.chmod(name, mode, dir_fd=dir_fd)
        except _Truncated:
            pass  # the rest stays owned by the uid, under a top no one else can enter
        os.fchown(top, 0, 0)
        os.fchmod(top, 0o700)
    finally:
        os.close(top)


def sweep(uid: int, extra: Sequence[str] = ()) -> list[str]:
    """Remove the top-level entries owned by ``uid`` in the world-writable directories (what a call
    of the subprocess sandbox without Landlock can leave behind); return what was removed."""
    removed = []
    for d in (*SWEPT_DIRS, *extra):
        try:
            dfd = os.open(d, DIR_FLAGS)
        except OSError:
            continue
        try:
            with os.scandir(dfd) as it:
                names = [e.name for e in it if _owned(e, uid)]
            for name in names:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_uid != uid:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    removed.append(f"{d}/{name}")
                except OSError:
                    continue
        finally:
            os.close(dfd)
    return removed


def _owned(entry: os.DirEntry[str], uid: int) -> bool:
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except OSError:
        return False



def root_dir(workdir_root: str | None) -> str:
    """The real path of the directory work dirs are made in: ``workdir_root``, else the system temp dir."""
    return os.path.realpath(workdir_root or tempfile.gettempdir())


def new_path(root: str, sandbox: str) -> str:
    """A fresh path for a call's outer directory under ``root``."""
    return os.path.join(root, f"{_PREFIX}{sandbox}-{secrets.token_hex(8)}")


def check_root(root: str, *, as_root: bool) -> None:
    """The dedicated uid must be able to reach its work dir (every ancestor searchable by others;
    checked only ``as_root``), and must not be able to move the work dirs (the root may be
    world-writable only with the sticky bit, like /tmp).

    Raises:
        SandboxUnavailableError: ``root`` is not such a directory (the message says what to change).
    """
    if not os.path.isdir(root):
        raise SandboxUnavailableError(f"workdir_root {root!r} is not a directory")
    mode = os.stat(root).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise SandboxUnavailableError(
            f"workdir_root {root!r} is writable by everyone without the sticky bit (mode "
            f"{stat.S_IMODE(mode):04o}): the sandbox's uid could move its work dir; chmod +t or o-w it")
    if not as_root:
        return
    path = root
    while True:
        mode = os.stat(path).st_mode
        if not mode & stat.S_IXOTH:
            raise SandboxUnavailableError(
                f"workdir_root {root!r} cannot be reached by the sandbox's uid: {path!r} has mode "
                f"{stat.S_IMODE(mode):04o} (no search permission for others); choose a directory every user "
                f"may enter (such as /tmp), or chmod o+x {path}")
        if path == "/":
            break
        path = os.path.dirname(path)


def create(outer: str, uid: int | None, seeded: list[tuple[str, bytes]], *, sandbox: str, root: str) -> int:
    """Create ``outer`` (root-owned, 0711) holding ``work`` (the uid's, 0700) with the ``seeded``
    files in it; return a descriptor of ``outer``. Nothing is left behind when it fails.

    Raises:
        SandboxError: ``outer`` could not be made in ``root``.
        SandboxInputError: a seeded file cannot be written there (a path through a seeded file ...).
    """
    try:
        os.mkdir(outer, 0o700)
    except OSError as exc:
        raise SandboxError(f"the {sandbox} sandbox could not create its work dir in workdir_root "
                           f"{root!r}: {exc.strerror}", sandbox=sandbox) from exc
    fd = -1
    try:
        fd = os.open(outer, DIR_FLAGS)
        os.mkdir(WORK, 0o700, dir_fd=fd)
        workdir = os.path.join(outer, WORK)
        for rel, content in seeded:  # the tree is ours alone until it is handed to the uid
            target = os.path.join(workdir, rel)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as fh:
                    fh.write(content)
            except OSError as exc:
                raise SandboxInputError(f"files: {rel!r} cannot be written into the work dir: "
                                        f"{exc.strerror}") from exc
        if uid is not None:
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), uid, uid)
            os.chown(WORK, uid, uid, dir_fd=fd, follow_symlinks=False)
        os.fchmod(fd, 0o711)
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        remove(outer)
        raise


def remove_leftover(outer: Any) -> None:
    """Remove the outer directory of a call whose process died mid-call (as its uid's lock file named
    it), if it is one: a directory of ours named like a work dir."""
    if isinstance(outer, str) and os.path.basename(outer).startswith(_PREFIX):
        with contextlib.suppress(OSError):
            st = os.lstat(outer)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                remove(outer)


def sweep_extra(root: str) -> list[str]:
    """The directories :func:`sweep` also clears for calls whose work dirs are in ``root``: ``root``
    itself when everyone may write there (and it is not one of :data:`SWEPT_DIRS`)."""
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return []
    return [root] if mode & stat.S_IWOTH and root not in SWEPT_DIRS else []
