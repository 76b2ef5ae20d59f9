"""Demand history per (MoE layer, expert): counts and routing-weight sums drained from the device,
decayed by a half-life in steps, persisted atomically (residency/persist.py: a kill at any
moment leaves the last good copy; a corrupt file is set aside with a warning)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from tidejax.residency.persist import clear_torn, set_aside, write_atomic

FORMAT = "tidejax-history/1"


class History:
    """counts / weights [L_moe, E] float64 (decayed), `steps` decode steps seen."""

    def __init__(self, n_layers: int, n_experts: int, half_life: float = 500.0):
        if half_life <= 0:
            raise ValueError(f"[residency] half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self.counts = np.zeros((n_layers, n_experts))
        self.weights = np.zeros((n_layers, n_experts))
        self.steps = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape

    def add(self, counts, weights, steps: int) -> None:
        """Decays what was there by `steps` steps of half-life, then adds a drain's counters."""
        decay = 0.5 ** (steps / self.half_life)
        self.counts = self.counts * decay + np.asarray(counts, np.float64)
        self.weights = self.weights * decay + np.asarray(weights, np.float64)
        self.steps += steps

    def save(self, path: str | os.PathLike) -> None:
        """Atomic (persist.write_atomic): a kill at any moment leaves the last good copy."""
        buf = io.BytesIO()
        np.savez(buf, format=np.array(FORMAT), counts=self.counts, weights=self.weights,
                 steps=np.array(self.steps), half_life=np.array(self.half_life))
        write_atomic(path, buf.getvalue())

    @staticmethod
    def read(path: str | os.PathLike, half_life: float | None = None) -> "History":
        """Reads a saved history; errors name the file."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["format"]) != FORMAT:
                    raise ValueError(f"format {str(z['format'])!r}, expected {FORMAT!r}")
                counts, weights = z["counts"], z["weights"]
                steps, saved_half_life = int(z["steps"]), float(z["half_life"])
        except FileNotFoundError:
            raise
        except Exception as e:  # a torn or foreign file: name it
            raise ValueError(f"{path}: not a demand history ({type(e).__name__}: {e})") from None
        if counts.ndim != 2 or weights.shape != counts.shape:
            raise ValueError(f"{path}: counts {counts.shape} and weights {weights.shape} must be "
                             "[L_moe, E]")
        history = History(*counts.shape, half_life=half_life or saved_half_life)
        history.counts, history.weights, history.steps = counts.astype(np.float64), weights, steps
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
