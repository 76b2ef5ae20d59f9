"""Demand history per (MoE layer, expert): counts and routing-weight sums drained from the device,
decayed by a half-life in steps, persisted atomically (residency/persist.py: a kill at any
moment leaves the last good copy; a corrupt file is set aside with a warning).

The planner, the boot map and seed maps rank by `demand`, the routing-weight sums: a pick the
router weighs at 0.6 asks for its expert more than one at 0.05, and a miss of the first costs
more output. A history saved with counts alone (no `weights`, or weights all zero beside
counts) still loads: until its first drain its demand is its counts, and that drain migrates it,
the counts times the routing weight a pick carried on average in that drain (`add`), so the
old demand and the new are in one unit.

Speculating with a model's MTP layer ([speculative] method "mtp"), its routed experts are one
more MoE layer of the residency geometry, after the main model's: the history then has
L_moe + 1 layers, and says so (`mtp_layers`, saved; absent in a file: 0). A saved history whose
main layers match but whose MTP layers differ (speculation turned on or off since) is migrated
at resume with one line: the main layers' demand kept, the MTP layer's starting at zero or
dropped (`with_mtp_layers`). Any other shape is set aside with a warning.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import numpy as np

from tidejax.residency.persist import clear_torn, set_aside, write_atomic

FORMAT = "tidejax-history/1"

log = logging.getLogger("tidejax.residency")


class History:
    """counts / weights [L_moe, E] float64 (decayed), `steps` decode steps seen, of which the last
    `mtp_layers` layers are MTP layers' (module docstring); `from_counts`: the weights are a
    count-only history's counts, to migrate at the next drain."""

    def __init__(self, n_layers: int, n_experts: int, half_life: float = 500.0,
                 mtp_layers: int = 0):
        if half_life <= 0:
            raise ValueError(f"[residency] half_life must be > 0, got {half_life}")
        if not 0 <= mtp_layers < n_layers:
            raise ValueError(f"mtp_layers {mtp_layers} must be in [0, {n_layers})")
        self.half_life, self.mtp_layers = half_life, mtp_layers
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

    def with_mtp_layers(self, mtp_layers: int) -> "History":
        """This history with `mtp_layers` MTP layers after the same main layers: the main
        layers' counts and weights kept, an MTP layer kept where both have it, zero where it is
        new, dropped where it is not wanted."""
        main = self.shape[0] - self.mtp_layers
        out = History(main + mtp_layers, self.shape[1], self.half_life, mtp_layers)
        keep = main + min(mtp_layers, self.mtp_layers)
        out.counts[:keep], out.weights[:keep] = self.counts[:keep], self.weights[:keep]
        out.steps, out.from_counts = self.steps, self.from_counts
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Atomic (persist.write_atomic): a kill at any moment leaves the last good copy."""
        buf = io.BytesIO()
        np.savez(buf, format=np.array(FORMAT), counts=self.counts,
                 **({} if self.from_counts else {"weights": self.weights}),
                 steps=np.array(self.steps), half_life=np.array(self.half_life),
                 mtp_layers=np.array(self.mtp_layers))
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
                mtp_layers = int(z["mtp_layers"]) if "mtp_layers" in z.files else 0
        except FileNotFoundError:
            raise
        except Exception as e:  # a torn or foreign file: name it (not numpy's advice to unpickle)
            why = "pickled objects" if "allow_pickle" in str(e) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}: not a demand history ({why})") from None
        if counts.ndim != 2 or weights.shape != counts.shape:
            raise ValueError(f"{path}: counts {counts.shape} and weights {weights.shape} must be "
                             "[L_moe, E]")
        if not 0 <= mtp_layers < counts.shape[0]:
            raise ValueError(f"{path}: mtp_layers = {mtp_layers}, of {counts.shape[0]} layers")
        history = History(*counts.shape, half_life=half_life or saved_half_life,
                          mtp_layers=mtp_layers)
        history.counts, history.steps = counts.astype(np.float64), steps
        history.from_counts = bool(counts.sum() > 0 and not weights.any())
        history.weights = (history.counts.copy() if history.from_counts
                           else weights.astype(np.float64))
        return history

    @staticmethod
    def resume(path: str | os.PathLike, n_layers: int, n_experts: int, half_life: float,
               mtp_layers: int = 0) -> "History | None":
        """The saved history at `path` if there is a usable one, migrated to `mtp_layers` MTP
        layers (of the n_layers) where only those differ (module docstring); a corrupt file or
        one of another shape is renamed aside (`*.corrupt-<time>`) with a warning. None when
        there is none."""
        path = Path(path)
        clear_torn(path)
        if not path.exists():
            return None
        try:
            history = History.read(path, half_life)
            saved_main = history.shape[0] - history.mtp_layers
            if (saved_main, history.shape[1]) != (n_layers - mtp_layers, n_experts):
                raise ValueError(f"{path}: shape {history.shape} with {history.mtp_layers} MTP "
                                 f"layers, this model has {(n_layers, n_experts)} with "
                                 f"{mtp_layers}")
            if history.mtp_layers != mtp_layers:
                log.info("%s: the demand of %d MoE layers kept; the MTP layer's %s "
                         "([speculative] method is %s)", path, saved_main,
                         "starts at zero" if mtp_layers else "dropped",
                         "'mtp'" if mtp_layers else "not 'mtp'")
                history = history.with_mtp_layers(mtp_layers)
            return history
        except ValueError as e:
            set_aside(path, str(e), "a fresh history")
            return None
