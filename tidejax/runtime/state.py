"""DecodeState: everything a step changes on the device, as one pytree donated into every step.

    cache     the KV cache, a kv.paged.PagedCache: the shared page pool and each lane's fixed
              rows (DeepSeek-V4.1's and V4's window rings)
    experts   the residency ExpertState: bank, rowmap, demand counters, host pool
    sampling  LaneSampling: each lane's sampling parameters [lanes], set when a request is
              admitted or resumed (steps.Steps.set_lane), not sent with every step, and its
              request's token counts [lanes, vocab] (for the penalties), updated in the step
    drafts    with speculative decoding, each lane's k drafted tokens and their distributions
              (runtime/speculative.Drafts), written by every step that decodes the lane; None
              without

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
from tidejax.runtime.speculative import Drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: PagedCache
    experts: ExpertState
    sampling: LaneSampling
    drafts: Drafts | None = None

    @staticmethod
    def create(cache: PagedCache, experts: ExpertState, lanes: int, vocab: int, mesh,
               k: int = 0) -> "DecodeState":
        """`cache` and `experts` already placed; every lane greedy until a request is admitted;
        k > 0: room for k drafts a lane. The sampling arrays (and drafts) are committed to
        `mesh`'s devices, as the steps return them (one compile)."""
        drafts = parallel.replicated(Drafts.create(lanes, k, vocab), mesh) if k else None
        return DecodeState(cache, experts,
                           parallel.replicated(LaneSampling.create(lanes, vocab), mesh), drafts)

    def replace(self, **fields) -> "DecodeState":
        return dataclasses.replace(self, **fields)
