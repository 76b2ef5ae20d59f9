"""Demand history per (MoE layer, expert): counts and routing-weight sums drained from the device,
decayed by a half-life in steps, persisted atomically (residency/persist.py: a kill at any
moment leaves the last good copy; a corrupt file is set aside with a warning).

The planner, the boot map and seed maps rank by `demand`, the routing-weight sums: a pick the
router weighs at 0.6 asks for its expert more than one at 0.05, and a miss of the first costs
more output. A history saved with counts alone (no `weights`, or weights all zero beside
counts) still loads: until its first drain its demand is its counts, and that drain migrates it,
the counts times the routing weight a pick carried on average in that drain (`add`), so the
old demand and the new are in one unit.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from tidejax.residency.persist import clear_torn, set_aside, write_atomic

FORMAT = "tidejax-history/1"


class History:
    """counts / weights [L_moe, E] float64 (decayed), `steps` decode steps seen; `from_counts`:
    the weights are a count-only history's counts, to migrate at the next drain."""

    def __init__(self, n_layers: int, n_experts: int, half_life: float = 500.0):
        if half_life <= 0:
            raise ValueError(f"[residency] half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self.counts = np.zeros((n_layers, n_experts))
        self.weights = np.zeros((n_layers, n_experts))
        self.steps = 0
        self.from_counts = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape

    @property
    def demand(self) -> np.ndarray:
        """[L_moe, E]: what the planner, the boot map and seed maps rank by (the routing-weight
        sums; a count-only history's counts until its first drain)."""
        return self.weights

    def add(self, counts, weights, steps: int) -> None:
        """Decays what was there by `steps` steps of half-life, then adds a drain's counters; a
        count-only history's weights become its counts times this drain's mean weight a pick."""
        counts, weights = np.asarray(counts, np.float64), np.asarray(weights, np.float64)
        if self.from_counts and counts.sum() > 0:
            self.weights = self.counts * (weights.sum() / counts.sum())
            self.from_counts = False
        decay = 0.5 ** (steps / self.half_life)
        self.counts = self.counts * decay + counts
        self.weights = self.weights * decay + weights
        self.steps += steps

    def save(self, path: str | os.PathLike) -> None:
        """Atomic (persist.write_atomic): a kill at any moment leaves the last good copy."""
        buf = io.BytesIO()
        np.savez(buf, format=np.array(FORMAT), counts=self.counts,
                 **({} if self.from_counts else {"weights": self.weights}),
                 steps=np.array(self.steps), half_life=np.array(self.half_life))
        write_atomic(path, buf.getvalue())

    @staticmethod
    def read(path: str | os.PathLike, half_life: float | None = None) -> "History":
        """Reads a saved history (one of counts alone too: see the module docstring); errors name
        the file."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["format"]) != FORMAT:
                    raise ValueError(f"format {str(z['format'])!r}, expected {FORMAT!r}")
                counts = z["counts"]
                weights = z["weights"] if "weights" in z.files else np.zeros_like(counts)
                steps, saved_half_life = int(z["steps"]), float(z["half_life"])
        except FileNotFoundError:
            raise
        except Exception as e:  # a torn or foreign file: name it (not numpy's advice to unpickle)
            why = "pickled objects" if "allow_pickle" in str(e) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}: not a demand history ({why})") from None
        if counts.ndim != 2 or weights.shape != counts.shape:
            raise ValueError(f"{path}: counts {counts.shape} and weights {weights.shape} must be "
                             "[L_moe, E]")
        history = History(*counts.shape, half_life=half_life or saved_half_life)
        history.counts, history.steps = counts.astype(np.float64), steps
        history.from_counts = bool(counts.sum() > 0 and not weights.any())
        history.weights = (history.counts.copy() if history.from_counts
                           else weights.astype(np.float64))
        return history

    @staticmethod
    def resume(path: str | os.PathLike, n_layers: int, n_experts: int,
               half_life: float) -> "History | None":
        """The saved history at `path` if there is a usable one; a corrupt file or one of another
        shape is renamed aside (`*.corrupt-<time>`) with a warning. None when there is none."""
        path = Path(path)
        clear_torn(path)
        if not path.exists():
            return None
        try:
            history = History.read(path, half_life)
            if history.shape != (n_layers, n_experts):
                raise ValueError(f"{path}: shape {history.shape}, this model has "
                                 f"{(n_layers, n_experts)}")
            return history
        except ValueError as e:
            set_aside(path, str(e), "a fresh history")
            return None
