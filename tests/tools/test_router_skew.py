"""tools/make_synthetic.py --router-skew: correction biases under which the 30% most picked of
each MoE layer's experts take about 70% of its picks, as the tool measures on random hidden
states through the written routers (the GGUF copy of the biases: tests/tools/test_gguf.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tidejax.checkpoint.safetensors_io import SafetensorsFile

REPO = Path(__file__).resolve().parents[2]
MEASURED = re.compile(r"the (\d+) most picked of each MoE layer's (\d+) experts take ([0-9.]+) of "
                      r"the picks \(per layer ([0-9.]+) to ([0-9.]+);")


def synthetic(out: Path, *args: str) -> tuple[int, int, float, float, float]:
    """Writes a tiny synthetic; (hot, experts, mean share, lowest, highest) as the tool prints."""
    done = subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out),
                           "--workers", "1", *args], cwd=REPO, check=True, capture_output=True, text=True)
    found = MEASURED.search(done.stdout)
    assert found, done.stdout
    return (int(found[1]), int(found[2])) + tuple(float(v) for v in found.groups()[2:])


@pytest.mark.parametrize("shape", [["--tiny"], ["--shape", "ds41-tiny", "--layers", "2",
                                                "--n-experts", "20"]])
def test_skewed_routers_give_70_percent_to_30_percent(tmp_path, shape):
    hot, e, mean, low, high = synthetic(tmp_path / "plain", *shape)
    assert hot == round(0.3 * e)
    assert abs(mean - hot / e) <= 0.1  # without: about the hot experts' share of the count
    hot, e, mean, low, high = synthetic(tmp_path / "skew", *shape, "--router-skew")
    assert abs(mean - 0.7) <= 0.03 and 0.65 <= low <= high <= 0.75  # the stated tolerance

    cfg = json.loads((tmp_path / "skew" / "config.json").read_text())
    skew = cfg["tidejax_synthetic"]["router_skew"]
    assert skew["hot"] == hot and skew["bias"] > 0 and skew["target_share"] == 0.7
    shards = [SafetensorsFile(p) for p in sorted((tmp_path / "skew").glob("*.safetensors"))]
    biases = {n: np.asarray(f.view(n)) for f in shards for n in f.tensors
              if n.endswith(("e_score_correction_bias", "ffn.gate.bias"))}
    hot_sets = []
    for bias in biases.values():  # `hot` experts a layer at the bias, the others at 0
        assert sorted(set(bias.tolist())) == [0.0, np.float32(skew["bias"])]
        hot_sets.append(frozenset(np.nonzero(bias)[0].tolist()))
        assert len(hot_sets[-1]) == hot
    assert len(biases) == 2 and hot_sets[0] != hot_sets[1]  # drawn per layer
