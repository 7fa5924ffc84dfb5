"""The pytest plugin of cassettes: a ``cassette`` fixture that records a test's provider exchanges
once and replays them by normalised request (:mod:`fsm_agent.testing.cassette`).

Enable it in the ``conftest.py`` at the root of your tests (it is not loaded by itself)::

    pytest_plugins = ["fsm_agent.testing.pytest_plugin"]

or for one run with ``pytest -p fsm_agent.testing.pytest_plugin``. Then::

    async def test_weather(cassette, agent):
        result = await agent.run("Weather in Paris?")       # every provider call goes through it
        assert result.stop.reason is StopReason.COMPLETED

The file is ``cassettes/<test module>/<test name>.json`` beside the test module (a parametrised
test's id is part of the name). ``@pytest.mark.cassette(...)`` changes it for a test: a path
(relative to the test module's folder) and any :class:`~fsm_agent.testing.Cassette` option::

    @pytest.mark.cassette("cassettes/shared.json", ignore=["body.temperature"], allow_repeats=True)

The record mode is ``--cassette-mode`` (``once``, ``new_episodes``, ``none``, ``all``), else
``$FSM_AGENT_CASSETTE_MODE``, else a ``record_mode`` in the marker, else ``none``: replay only, so
a test never reaches a provider unless asked to (as pytest-recording does). Record the first time
with ``pytest --cassette-mode=once``; re-record everything with ``--cassette-mode=all``.
A test whose provider sends a request the cassette does not have fails with
:class:`~fsm_agent.testing.CassetteMismatch`, which lists what changed; the fixture also fails the
test at teardown with that message when the code under test caught the error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .cassette import RECORD_MODES, Cassette, CassetteMismatch

__all__ = ["cassette", "pytest_addoption", "pytest_configure", "pytest_runtest_makereport"]

ENV = "FSM_AGENT_CASSETTE_MODE"
_CALL_FAILED = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--cassette-mode``: the record mode of every ``cassette`` fixture of the run."""
    group = parser.getgroup("fsm_agent", "fsm_agent cassettes")
    group.addoption("--cassette-mode", choices=RECORD_MODES, default=None,
                    help=f"record mode of the `cassette` fixture: {', '.join(RECORD_MODES)} "
                         f"(default: ${ENV}, else the marker's, else none: replay only)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``cassette`` marker."""
    config.addinivalue_line("markers", "cassette(path=None, **options): the cassette file (relative to the test "
                                       "module) and fsm_agent.testing.Cassette options of the `cassette` fixture")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Remember whether the test itself failed (the fixture then does not report its mismatch twice)."""
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


def _mode(config: pytest.Config, marked: str | None) -> str:
    mode = config.getoption("--cassette-mode") or os.environ.get(ENV) or marked or "none"
    if mode not in RECORD_MODES:
        raise pytest.UsageError(f"{ENV}={mode!r}: use one of {', '.join(RECORD_MODES)}")
    return mode


def _default_path(request: pytest.FixtureRequest) -> Path:
    module = Path(str(request.node.path))
    name = re.sub(r"[^\w.\-\[\]]+", "_", request.node.name)
    return module.parent / "cassettes" / module.stem / f"{name}.json"


@pytest.fixture
def cassette(request: pytest.FixtureRequest) -> Iterator[Cassette]:
    """The test's :class:`~fsm_agent.testing.Cassette`, in use for the whole test (see the module
    docstring for its file, its mode and the marker)."""
    options: dict[str, Any] = {}
    path = _default_path(request)
    marker = request.node.get_closest_marker("cassette")
    if marker is not None:
        options = dict(marker.kwargs)
        given = marker.args[0] if marker.args else options.pop("path", None)
        if given is not None:
            path = Path(str(request.node.path)).parent / given
    options["record_mode"] = _mode(request.config, options.get("record_mode"))
    cas = Cassette(path, **options)
    original = cas.replay
    refused: list[CassetteMismatch] = []

    def replay(*args: Any) -> Any:
        try:
            return original(*args)
        except CassetteMismatch as exc:
            refused.append(exc)
            raise

    cas.replay = replay  # type: ignore[method-assign,assignment]
    with cas:
        yield cas
    if refused and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail(str(refused[0]), pytrace=False)
