"""DecodeState: everything a step changes on the device, as one pytree donated into every step.

    cache     the KV cache, a kv.paged.PagedCache: the shared page pool and each lane's fixed
              rows (DeepSeek-V4.1's and V4's window rings)
    experts   the residency ExpertState: bank, rowmap, demand counters, host pool
    sampling  LaneSampling: each lane's sampling parameters [lanes], set when a request is
              admitted or resumed (steps.Steps.set_lane), not sent with every step, and its
              request's token counts [lanes, vocab] (for the penalties), updated in the step

The runner (runtime/runner.py) holds the one DecodeState and is the only caller of the steps
(runtime/steps.py) that take it and return it updated in place.
"""

from __future__ import annotations

import dataclasses

import jax

from tidejax import parallel
from tidejax.kv.paged import PagedCache
from tidejax.residency.state import ExpertState
from tidejax.runtime.sampling import LaneSampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: PagedCache
    experts: ExpertState
    sampling: LaneSampling

    @staticmethod
    def create(cache: PagedCache, experts: ExpertState, lanes: int, vocab: int,
               mesh) -> "DecodeState":
        """`cache` and `experts` already placed; every lane greedy until a request is admitted.
        The sampling arrays are committed to `mesh`'s devices, as the steps return them (one
        compile)."""
        return DecodeState(cache, experts,
                           parallel.replicated(LaneSampling.create(lanes, vocab), mesh))

    def replace(self, **fields) -> "DecodeState":
        return dataclasses.replace(self, **fields)
