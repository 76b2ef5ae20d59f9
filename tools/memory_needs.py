"""What a published MoE model needs in memory, from tidejax's own declarations of its shape.

    python -m tools.memory_needs --shape glm45-air [--experts mxfp4] [--kv-tokens 65536]
                                 [--reserve-gib 8] [--budget-gib 32 ...]

The shape is tools/make_synthetic.py's, at the published model's layer count and vocabulary
(PUBLISHED). Every figure comes from the code that serves the model:
- routed experts: one expert row as the checkpoint table reads it (its declared expert_specs,
  stored BF16, or MXFP4 where the model is published so: STORED) turned into the format the
  profile holds (models.loading.RowFormat, the loader's own conversion, on a row of zeros), its
  bytes by residency.pool.row_bytes; the host pool holds every one of them
- dense weights on the device: the family's declared params in bf16 (models.base.nbytes), the
  embedding and head among them; the MTP layers the family keeps on the host (its mtp_specs).
  With [speculative] method = "mtp" the first MTP layer's dense part goes to the device and its
  routed experts join the host pool as one more MoE layer of the residency geometry (rows in the
  format held, in the bank as the budget allows, like any layer's)
- KV: the family's cache_bytes_per_token in bf16
- `exact`'s transient slots: one MoE layer's experts (residency.manager: min(E, max_context x
  top_k) rows, which for any real context is E)
- budgets: residency.pool.budget_slots, as [residency] budget_gib turns into resident experts
For each card (DEVICES, the GiB a process can use) it prints the largest whole budget_gib whose
dense weights, bank, transient slots and KV pool leave --reserve-gib for working memory
(activations, XLA's scratch: not computed here, an allowance), and for each --budget-gib the
experts it holds and the device memory it takes.
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from tidejax.models.base import nbytes
from tidejax.models.layers.mtp import without_experts
from tidejax.models.loading import RowFormat
from tidejax.models.registry import family_for
from tidejax.residency.pool import budget_slots, row_bytes
from tools.make_synthetic import shape_config
from tools.synthetic_layout import Declared, family_weights

# shape -> (layers, vocabulary, MTP layers) of the published config.json
PUBLISHED = {
    "v3": (61, 129280, 1),
    "glm45-air": (46, 151552, 1),
    "glm45": (92, 151552, 1),
    "glm5": (78, 154880, 1),
    "qwen3-235b": (94, 151936, 0),
    "qwen3-30b": (48, 151936, 0),
    "gpt-oss-120b": (36, 201088, 0),
    "gpt-oss-20b": (24, 201088, 0),
    "mixtral-8x7b": (32, 32000, 0),
    "mixtral-8x22b": (56, 32768, 0),
    "minimax-m2": (62, 200064, 0),
}
STORED = {"gpt-oss-120b": "mxfp4", "gpt-oss-20b": "mxfp4"}  # routed experts as published; else bf16
V3_DENSE_LAYERS = 3  # DeepSeek-V3's first_k_dense_replace (the other shapes carry their own)
# the GiB one process can use of each card
DEVICES = {"48 GB (L40S, RTX 6000 Ada)": 44.0, "80 GB (H100, A100)": 78.0,
           "H200 (141 GB)": 139.0}
GIB, MIB, KIB = 2**30, 2**20, 2**10


class Needs:
    """The memory the published shape `shape` needs with its routed experts held as `experts`
    ("mxfp4", "bf16" or "checkpoint": as stored)."""

    def __init__(self, shape: str, experts: str):
        if shape not in PUBLISHED:
            raise SystemExit(f"error: --shape {shape}: no published layer count and vocabulary "
                             f"for it (known: {', '.join(PUBLISHED)})")
        layers, vocab, mtp_layers = PUBLISHED[shape]
        raw = shape_config(shape, layers, V3_DENSE_LAYERS if shape == "v3" else None, vocab,
                           4096, {})
        declared = Declared.of(raw)
        family = family_for(raw, "published config.json")
        self.shape, self.experts_held, self.cfg = shape, experts, declared.cfg
        self.moe_layers = declared.table.expert_layers
        self.total = declared.experts["gate_up"].shape[0]  # rows: MoE layers x experts
        self.n_experts = self.total // len(self.moe_layers)
        self.top_k = self.cfg.num_experts_per_tok
        stored = self._stored_row(declared.experts, STORED.get(shape, "bf16"))
        held = RowFormat(experts, jnp.bfloat16).convert(stored)
        self.stored_bytes = row_bytes({k: v[None] for k, v in stored.items()})
        self.expert_bytes = row_bytes({k: v[None] for k, v in held.items()})
        self.dense_bytes = nbytes(declared.params)
        self.embed_head_bytes = nbytes([declared.params["embed"], declared.params["lm_head"]])
        self.mtp_bytes, self.mtp_dense_bytes = self._mtp_bytes(family, raw, mtp_layers)
        # speculating: the drafting MTP layer's routed experts, one more MoE layer of the pool
        self.mtp_pool_bytes = self.n_experts * self.expert_bytes if self.mtp_bytes else 0
        self.kv_per_token = family.cache_bytes_per_token(self.cfg, jnp.bfloat16)

    @staticmethod
    def _stored_row(expert_specs: dict, stored: str) -> dict:
        """One expert row of zeros as the checkpoint table reads it: the declared leaves
        without their row axis, BF16, its matrices MXFP4 blocks and scales where `stored` is
        "mxfp4"."""
        row = {k: np.zeros(s.shape[1:], jnp.bfloat16) for k, s in expert_specs.items()}
        return RowFormat(stored, jnp.bfloat16).convert(row) if stored == "mxfp4" else row

    @staticmethod
    def _mtp_bytes(family, raw: dict, mtp_layers: int) -> tuple[int, int]:
        """(The published MTP layers' bytes in bf16, where the family keeps them (mtp_specs);
        the first one's without its routed experts: what speculating puts on the device)."""
        weights = family_weights(raw)
        if not mtp_layers or not hasattr(weights, "mtp_specs"):
            return 0, 0
        with_mtp = raw | {"num_nextn_predict_layers": mtp_layers}
        cfg = family.config_from_hf(with_mtp, "published config.json")
        specs = weights.mtp_specs(cfg, jnp.bfloat16)
        first = specs[f"layers_{cfg.num_layers}"]
        return nbytes(specs), nbytes(without_experts(first))

    @property
    def pool_bytes(self) -> int:
        return self.total * self.expert_bytes

    @property
    def load_bytes(self) -> int:
        """Host memory at load: the pool, the dense weights on their way to the device."""
        return self.pool_bytes + self.dense_bytes

    @property
    def transient_bytes(self) -> int:
        return self.n_experts * self.expert_bytes

    def slots(self, budget_gib: float) -> int:
        return budget_slots(0, budget_gib, self.expert_bytes, self.total)

    def device_bytes(self, budget_gib: float, kv_tokens: int) -> int:
        """Dense weights, the bank, exact's transient slots (none when all are resident) and the
        KV pool."""
        slots = self.slots(budget_gib)
        transient = 0 if slots >= self.total else self.transient_bytes
        return (self.dense_bytes + slots * self.expert_bytes + transient
                + kv_tokens * self.kv_per_token)

    def largest_budget(self, device_gib: float, kv_tokens: int, reserve_gib: float) -> int | None:
        """The largest whole budget_gib (0: every expert) that leaves `reserve_gib` of the card
        free, or None where even one GiB does not fit."""
        room = (device_gib - reserve_gib) * GIB
        if self.device_bytes(0, kv_tokens) <= room:
            return 0
        fits = [b for b in range(1, int(device_gib) + 1) if self.device_bytes(b, kv_tokens) <= room]
        return fits[-1] if fits else None


def report(needs: Needs, kv_tokens: int, reserve_gib: float, budgets: list[float]) -> list[str]:
    n = needs
    held = {"mxfp4": "MXFP4", "bf16": "BF16", "checkpoint": "as stored"}[n.experts_held]
    lines = [
        f"{n.shape}: {n.cfg.num_layers} layers, {len(n.moe_layers)} MoE x {n.n_experts} = "
        f"{n.total:,} routed experts, {n.top_k} a token",
        f"expert: {n.expert_bytes / MIB:.2f} MiB held {held} ({n.stored_bytes / MIB:.2f} MiB as "
        f"stored, {STORED.get(n.shape, 'bf16').upper()})",
        f"host pool: {n.pool_bytes / GIB:.1f} GiB ({n.total * n.stored_bytes / GIB:.1f} GiB as "
        f"stored); with the dense weights while they load: {n.load_bytes / GIB:.1f} GiB",
        f"dense on the device: {n.dense_bytes / GIB:.2f} GiB ({n.embed_head_bytes / GIB:.2f} of "
        f"it the embedding and the head)",
    ]
    if n.mtp_bytes:
        lines += [f"MTP layers on the host: {n.mtp_bytes / GIB:.1f} GiB in bf16",
                  f"  speculating (method \"mtp\"): {n.mtp_dense_bytes / GIB:.2f} GiB of it on "
                  f"the device; its {n.n_experts} routed experts one more MoE layer of the host "
                  f"pool (+{n.mtp_pool_bytes / GIB:.2f} GiB held {held}), in the bank as the "
                  "budget allows"]
    lines += [
        f"KV: {n.kv_per_token / KIB:.1f} KiB a token; {kv_tokens:,} tokens: "
        f"{kv_tokens * n.kv_per_token / GIB:.2f} GiB",
        f"exact's transient slots: {n.n_experts} experts, {n.transient_bytes / GIB:.2f} GiB",
        f"largest budget_gib leaving {reserve_gib:g} GiB of working memory "
        f"(KV {kv_tokens:,} tokens):",
    ]
    for device, gib in DEVICES.items():
        best = n.largest_budget(gib, kv_tokens, reserve_gib)
        lines.append(f"  {device}: " + ("does not fit" if best is None else _budget(n, best,
                                                                                   kv_tokens)))
    lines += [f"budget_gib = {b:g}: " + _budget(n, b, kv_tokens) for b in budgets]
    return lines


def _budget(n: Needs, budget_gib: float, kv_tokens: int) -> str:
    slots = n.slots(budget_gib)
    return (f"{budget_gib:g} -> {slots:,} experts ({100 * slots / n.total:.0f}%), "
            f"{n.device_bytes(budget_gib, kv_tokens) / GIB:.1f} GiB on the device")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(PUBLISHED))
    parser.add_argument("--experts", choices=("mxfp4", "bf16", "checkpoint"), default="mxfp4",
                        help="[model] experts: how the routed experts are held")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="[engine] kv_pool_tokens")
    parser.add_argument("--reserve-gib", type=float, default=8.0,
                        help="device memory left for activations and XLA's scratch")
    parser.add_argument("--budget-gib", type=float, nargs="*", default=[],
                        help="[residency] budget_gib values to report")
    args = parser.parse_args(argv)
    if args.kv_tokens < 0 or args.reserve_gib < 0 or any(b < 0 for b in args.budget_gib):
        raise SystemExit("error: --kv-tokens, --reserve-gib and --budget-gib must not be negative")
    print("\n".join(report(Needs(args.shape, args.experts), args.kv_tokens, args.reserve_gib,
                           args.budget_gib)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
