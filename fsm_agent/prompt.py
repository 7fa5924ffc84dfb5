"""The agent's system prompt as a versioned source that may change while the agent runs.

An :class:`~fsm_agent.Agent` holds one :class:`PromptSource`: the text given in code
(``Agent(system_prompt="...")``, changed later with :meth:`Agent.set_system_prompt
<fsm_agent.Agent.set_system_prompt>`), or a :class:`PromptFile` the source re-reads when its
content changes. Each change of the text gets the next version (1, 2, ...). Reading it is thread
safe (one lock): a setter in another thread and a run reading it at its PreTurn see one whole
version.

The engine never reads the source itself: it asks the run's effect port
(:meth:`EffectPort.system_prompt <fsm_agent.machine.port.EffectPort.system_prompt>`), so a recorded
run replays the prompt it saw, and a Temporal workflow's replay sees the value its history holds.
See docs/system-prompt.md.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from attrs import frozen

from .errors import ConfigurationError

__all__ = ["PROMPT_KEY", "PromptFile", "PromptSnapshot", "PromptSource", "prompt_digest"]

log = logging.getLogger("fsm_agent.prompt")

PROMPT_KEY = "system_prompt"
"""Key of the session's prompt record in ``RunState.metadata`` (checkpointed): ``version``,
``digest``, ``source``, ``text`` of the prompt its model calls use, ``leading`` (the transcript's
first message is that prompt as the session started) and ``own`` (the session brought its own
system message, which is kept)."""


def prompt_digest(text: str | None) -> str:
    """The content hash that names a prompt text (16 hex characters; ``None`` hashes as ``""``)."""
    return hashlib.sha256((text or "").encode("utf-8")).hexdigest()[:16]


@frozen
class PromptSnapshot:
    """The system prompt at one moment: what a run's PreTurn reads through its port."""

    version: int
    """The source's version (1 for the text it started with; each change adds one)."""
    text: str | None
    """The prompt (``None``: no system prompt)."""
    digest: str
    """:func:`prompt_digest` of :attr:`text`."""
    source: str
    """Where the text came from: ``code`` (given in code) or ``file:<absolute path>``."""


class PromptFile:
    """A system prompt kept in a text file, followed while the agent runs::

        agent = Agent(provider, system_prompt=PromptFile("prompts/support.md"))

    The file is read when the source is made (a missing or unreadable file raises there), then again
    at each PreTurn of every run (through the run's port); when its content changed, the next model
    call uses the new text. Surrounding whitespace is stripped; an empty file means no system prompt.
    A file that cannot be read later (an editor replacing it, a bad encoding) keeps the last text, with
    a warning on the ``fsm_agent.prompt`` logger.

    Args:
        path: the file (relative paths are resolved now).
        encoding: its text encoding.
        max_bytes: the largest file taken (bytes); a larger one is refused.

    Raises:
        ConfigurationError: ``max_bytes`` is not positive.
    """

    __slots__ = ("path", "encoding", "max_bytes")

    def __init__(self, path: str | Path, *, encoding: str = "utf-8", max_bytes: int = 1_000_000) -> None:
        if max_bytes <= 0:
            raise ConfigurationError(f"PromptFile max_bytes must be positive, not {max_bytes}")
        self.path = Path(path).expanduser().resolve()
        self.encoding = encoding
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"PromptFile({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PromptFile) and (self.path, self.encoding) == (other.path, other.encoding)

    def __hash__(self) -> int:
        return hash((self.path, self.encoding))

    @property
    def label(self) -> str:
        """``file:<absolute path>``."""
        return f"file:{self.path}"

    def read(self) -> str | None:
        """The file's text, stripped (``None`` when empty).

        Raises:
            ConfigurationError: the file is missing, unreadable, larger than ``max_bytes`` or not
                text in its encoding.
        """
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ConfigurationError(f"cannot read the system prompt file {self.path}: {exc.strerror or exc}; "
                                     "give an existing text file") from None
        if len(data) > self.max_bytes:
            raise ConfigurationError(f"the system prompt file {self.path} has {len(data)} bytes, more than "
                                     f"max_bytes={self.max_bytes}; is it the right file?")
        try:
            text = data.decode(self.encoding).strip()
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"the system prompt file {self.path} is not {self.encoding} text ({exc.reason} "
                                     f"at byte {exc.start})") from None
        return text or None


class PromptSource:
    """The agent's versioned system prompt (see the module doc).

    Args:
        initial: the text, a :class:`PromptFile`, or ``None`` (no system prompt).

    Raises:
        ConfigurationError: a file that cannot be read; a value of another type.
    """

    __slots__ = ("_lock", "_file", "_text", "_version", "_label")

    def __init__(self, initial: str | PromptFile | None = None) -> None:
        self._lock = threading.Lock()
        self._file: PromptFile | None = None
        self._text: str | None = None
        self._version = 0
        self._set(initial)
        self._label = self._file.label if self._file is not None else f"code:{prompt_digest(self._text)}"

    @property
    def label(self) -> str:
        """What this source is, fixed when it is made: ``file:<path>``, or ``code:<digest>`` of the text
        it was made with. A recorded run's prompt reads name it, so a replay by an agent configured with
        another prompt is told where it diverges, while one configured alike replays the recorded texts."""
        return self._label

    @property
    def file(self) -> PromptFile | None:
        """The file followed, or ``None`` (a prompt given in code)."""
        return self._file

    def _set(self, value: str | PromptFile | None) -> int:
        if isinstance(value, PromptFile):
            text = value.read()
            with self._lock:
                self._file = value
                return self._change(text)
        if value is not None and not isinstance(value, str):
            raise ConfigurationError(f"a system prompt is a str, a PromptFile or None, not {type(value).__name__}")
        with self._lock:
            self._file = None
            return self._change(value or None)

    def _change(self, text: str | None) -> int:
        if self._version == 0 or text != self._text:
            self._text = text
            self._version += 1
        return self._version

    def set(self, value: str | PromptFile | None) -> int:
        """Make ``value`` the prompt (a text, a file to follow, or ``None``); returns the version now in
        force. A text equal to the current one changes nothing (the version stays). Thread safe.

        Raises:
            ConfigurationError: a file that cannot be read (nothing changes); a value of another type.
        """
        return self._set(value)

    def current(self) -> PromptSnapshot:
        """The prompt now: a followed file is read again (a change gets the next version; a file that
        cannot be read keeps the last text). Thread safe; never raises once the source is made."""
        with self._lock:
            file = self._file
        if file is not None:
            try:
                text = file.read()
            except ConfigurationError as exc:
                log.warning("%s; the system prompt stays as last read", exc)
            else:
                with self._lock:
                    if self._file is file:
                        self._change(text)
        return self.cached()

    def cached(self) -> PromptSnapshot:
        """The prompt as last read or set, without reading a file."""
        with self._lock:
            text, version = self._text, self._version
            source = self._file.label if self._file is not None else "code"
        return PromptSnapshot(version, text, prompt_digest(text), source)

    def __repr__(self) -> str:
        snap = self.cached()
        return f"PromptSource({snap.source}, version {snap.version})"
