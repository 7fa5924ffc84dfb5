"""`from fsm_agent import default_middleware`, and the README tip that uses it runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import fsm_agent
from fsm_agent import Middleware, ScriptedProvider, default_middleware, tool
from fsm_agent.plugins import DEFAULT_MIDDLEWARE

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_default_middleware_is_exported_from_the_package() -> None:
    assert "default_middleware" in fsm_agent.__all__
    assert fsm_agent.default_middleware is fsm_agent.plugins.default_middleware
    made = default_middleware()
    assert [m.name for m in made] == list(DEFAULT_MIDDLEWARE)
    assert all(isinstance(m, Middleware) for m in made)
    assert all(a is not b for a, b in zip(made, default_middleware()))  # fresh instances each call


def test_the_readme_tip_runs_as_written() -> None:
    blocks = [b for b in re.findall(r"```python\n(.+?)```", README, re.S) if "default_middleware" in b]
    assert len(blocks) == 1, "the README should show default_middleware() in one Python block"
    assert "from fsm_agent import" in blocks[0] and "default_middleware" in blocks[0].split("\n")[0]

    @tool
    def lookup_order(order_id: str) -> dict:
        """Look up an order."""
        return {"order_id": order_id}

    class NoRefunds(Middleware):
        """As in the README."""

    names = {"provider": ScriptedProvider([]), "lookup_order": lookup_order, "NoRefunds": NoRefunds}
    exec(compile(blocks[0], "README.md", "exec"), names)  # noqa: S102 - the README's own code
    chain = [m.name for m in names["agent"].middleware]
    assert {*DEFAULT_MIDDLEWARE, "NoRefunds"} <= set(chain)
