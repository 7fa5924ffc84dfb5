"""Acceptance checks named by reference (``python = "task_checks:..."``) in the task tests."""

from __future__ import annotations

from typing import Any


def population_is_round(answer: Any) -> tuple[bool, str]:
    """The population the output gives ends in 000 (a figure rounded to thousands)."""
    population = (answer.output or {}).get("population", 0)
    return population % 1000 == 0, f"population {population} is not rounded to thousands"


async def mentions_the_city(answer: Any) -> bool:
    """The answer's text names the city the output gives (an async check)."""
    return (answer.output or {}).get("name", "?") in answer.text
