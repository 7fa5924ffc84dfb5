"""`run --agent M:A` without --temporal is refused (a newcomer's run silently used the embedded model
and none of the module's agent)."""

from __future__ import annotations

import io

from fsm_agent.cli import main


def test_run_with_agent_but_no_temporal_is_refused_before_anything_runs(tmp_path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["run", "--agent", "agents:mailer", "--store", str(tmp_path / "s.db"), "Mail it"], out=out, err=err)
    assert code == 2
    assert "--agent agents:mailer: `run` takes --agent only with --temporal" in err.getvalue()
    assert out.getvalue() == "" and not (tmp_path / "s.db").exists()
