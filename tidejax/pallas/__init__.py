"""GPU kernels (Pallas) behind plain functions, each with a jnp reference that runs everywhere."""

from tidejax.pallas.attention import (paged_mla_decode, paged_mla_decode_reference, paged_mla_prefill,
                                      paged_mla_prefill_reference)
from tidejax.pallas.bank import bank_dims, bank_format
from tidejax.pallas.demand import Demand, count_demand_reference
from tidejax.pallas.index_scores import paged_index_scores, paged_index_scores_reference
from tidejax.pallas.moe import moe_grouped, moe_grouped_reference

__all__ = [
    "Demand",
    "bank_dims",
    "bank_format",
    "count_demand_reference",
    "moe_grouped",
    "moe_grouped_reference",
    "paged_index_scores",
    "paged_index_scores_reference",
    "paged_mla_decode",
    "paged_mla_decode_reference",
    "paged_mla_prefill",
    "paged_mla_prefill_reference",
]
