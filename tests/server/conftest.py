"""Fixtures of the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .common import RAN


@pytest.fixture(autouse=True)
def _ran() -> Iterator[None]:
    RAN.clear()
    yield
    RAN.clear()
