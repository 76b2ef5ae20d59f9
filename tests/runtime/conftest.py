"""The runtime tests' shared checkpoints."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> Path:
    """A 2-layer synthetic DeepSeek-V4.1 (tools.make_synthetic's ds41-tiny shape)."""
    out = tmp_path_factory.mktemp("ds41") / "tiny"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out),
                    "--shape", "ds41-tiny", "--layers", "2", "--workers", "1"],
                   cwd=REPO, check=True, capture_output=True)
    return out

