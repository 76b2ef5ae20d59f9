"""bench/step_overhead.py runs on a tiny synthetic checkpoint and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import step_overhead  # noqa: E402


def test_step_overhead_on_a_tiny_synthetic_checkpoint(tmp_path, capsys):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_synthetic.py"), str(model),
                    "--tiny", "--workers", "1"], check=True, capture_output=True)
    assert step_overhead.main([str(model), "--steps", "6", "--lanes", "1,2",
                               "--resident", "1.0,0.5", "--set", "engine.max_context=128",
                               "--set", "residency.drain_every=4"]) == 0
    table = capsys.readouterr().out.split("| resident |")[-1].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert [(r[0], r[2]) for r in rows] == [("100%", "1"), ("100%", "2"), ("50%", "1"), ("50%", "2")]
    for row in rows:
        loop, engine, bare, ratio = map(float, row[3:])
        assert loop > 0 and engine > 0 and bare > 0
        assert abs(ratio - loop / bare) < 0.02 * ratio + 0.01
