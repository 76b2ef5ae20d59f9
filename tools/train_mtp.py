"""train_demo's `mtp` stage: one MTP ("NextN") layer for a trained demo checkpoint, the main model
frozen, with DeepSeek-V3's MTP objective: from the main model's hidden state at position p (as
its head reads it, after the final norm) and the embedding of the token at p + 1, predict the
token at p + 2 (cross-entropy through the main model's frozen head).

    python -m tools.train_demo mtp --model models/demo --out models/demo [--minutes 20]

The layer is DeepSeek-V3's published layout (`model.layers.{num_layers}.*`: enorm, hnorm,
eh_proj, an MLA + MoE block with the main model's expert count and width, shared_head.norm;
config.json's num_nextn_predict_layers = 1), its forward the engine's own
(tidejax.models.deepseek_v3.model.build_mtp) applied under jax.grad, so the layer trained is the
layer that drafts. It starts as a copy of the last decoder layer's block (attention, norms,
router and experts) with eh_proj and the MTP norms freshly initialized: a warm start for a short
CPU run. The export rewrites the checkpoint directory with the main weights unchanged and the
MTP layer added; training_log.json gets an "mtp" entry (loss curve, held-out loss and the
teacher-forced acceptance per domain).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from tools.train_demo import (adamw, balance_routers, balanced_batch, cosine_lr, export,
                              load_streams, log)


class MTPTrainer:
    """The frozen main model, the MTP layer's params and one jitted training step."""

    def __init__(self, model_dir: Path, seq: int, seed: int):
        import jax
        import jax.numpy as jnp

        from tidejax.kv.paged import PagedCache
        from tidejax.models.base import init
        from tidejax.models.deepseek_v3.config import DeepseekV3Config
        from tidejax.models.deepseek_v3.model import build, build_mtp
        from tidejax.models.deepseek_v3.weights import load_weights, mtp_specs
        from tidejax.models.layers.mla import MLACache
        from tidejax.models.layers.mtp import with_mtp_slots
        from tidejax.models.loading import ExpertPool
        from tidejax.residency.serve import ServeOptions
        from tidejax.residency.state import all_resident_state

        self.jax, self.jnp, self.seq = jax, jnp, seq
        stored = json.loads((model_dir / "config.json").read_text())
        main_cfg = DeepseekV3Config.from_hf(stored, str(model_dir / "config.json"))
        self.raw_cfg = stored | {"num_nextn_predict_layers": 1}
        self.cfg = cfg = DeepseekV3Config.from_hf(self.raw_cfg, "the MTP stage's config")
        serve = ServeOptions(kernel="reference", all_resident=True, count=True)
        n_moe, n_experts = len(cfg.moe_layers), cfg.n_routed_experts
        pool = ExpertPool(n_moe * n_experts, "checkpoint", np.float32)
        # the main model as stored (an MTP layer it may already have is replaced)
        main_params, _ = load_weights(main_cfg, model_dir, stored, serve, jnp.float32, pool.put_row)
        self.frozen = {"model": main_params,
                       "experts": {k: jnp.asarray(v) for k, v in pool.result().items()}}
        self.main = build(cfg, serve, jnp.float32)
        self.mtp = build_mtp(cfg, serve, jnp.float32)
        self.name = f"layers_{cfg.num_layers}"
        if cfg.moe_layers[-1] != cfg.num_layers - 1:
            raise ValueError(f"{model_dir / 'config.json'}: the last decoder layer is dense; the "
                             f"MTP stage starts its MoE block from that layer's")
        # warm start: the last decoder layer's block; eh_proj and the MTP norms from their init
        fresh = init(mtp_specs(cfg, jnp.float32), jax.random.PRNGKey(seed))[self.name]
        last = main_params[f"layers_{cfg.num_layers - 1}"]
        layer = {k: v for k, v in fresh.items() if k not in last} | jax.tree.map(jnp.copy, last)
        first = (n_moe - 1) * n_experts  # the last MoE layer's expert rows
        # copies (a slice of the whole is the same buffer): the step donates these
        self.params = {"layer": layer, "experts": {k: jnp.copy(v[first:first + n_experts])
                                                   for k, v in self.frozen["experts"].items()}}
        # a pool of one page of `seq` tokens a row, the MTP layer's slot included
        self._cache = lambda b: (PagedCache(MLACache.create(with_mtp_slots(cfg), b, seq,
                                                            jnp.float32)),
                                 jnp.arange(b, dtype=jnp.int32)[:, None])
        self._state = all_resident_state

    def main_forward(self, frozen, tokens):
        """tokens [b, t] -> the main model's logits [b, t, vocab] and head hidden [b, t, d]."""
        jnp = self.jnp
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache, table = self._cache(b)
        state = self._state(frozen["experts"], len(self.cfg.moe_layers))
        (logits, _, _), seen = self.main.apply({"params": frozen["model"]}, tokens, positions,
                                               jnp.ones((b, t), bool), cache, table, state,
                                               mutable=["intermediates"])
        return logits, seen["intermediates"]["head_hidden"][0]

    def draft_logits(self, params, frozen, hidden, tokens):
        """The MTP layer's logits [b, t, vocab] at positions 0..t-1 (each for the token at p + 2)
        from the main head hidden [b, t, d] and tokens [b, t] (the tokens at p + 1), and its
        demand counts [1, E]."""
        jnp = self.jnp
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        head = {k: frozen["model"][k] for k in ("embed", "lm_head") if k in frozen["model"]}
        logits, _, _, state = self.mtp.apply(
            {"params": head | {self.name: params["layer"]}}, hidden, tokens, positions,
            jnp.ones((b, t), bool), *self._cache(b), self._state(params["experts"], 1))
        return logits, state.counts

    def row_losses(self, params, frozen, batch):
        """batch [b, t + 2] -> the MTP loss per row [b] (the token at p + 2, p < t), the greedy
        acceptance per row [b] (its argmax equal to the main model's at p + 1, p < t - 1), the
        sampled acceptance per row [b] (sum min(p, q) at temperature 1: a one-token draft's
        chance to be kept), demand counts. Both forwards run t positions over a table of t
        tokens: the attention's static bound, which reverse-mode differentiation needs."""
        jax, jnp = self.jax, self.jnp
        main_logits, hidden = self.main_forward(frozen, batch[:, :-2])
        logits, counts = self.draft_logits(params, frozen, jax.lax.stop_gradient(hidden),
                                           batch[:, 1:-1])
        logq = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logq, batch[:, 2:, None], axis=-1)[..., 0]
        target = jax.lax.stop_gradient(main_logits[:, 1:])
        greedy = (logits[:, :-1].argmax(-1) == target.argmax(-1)).mean(axis=1)
        sampled = jnp.minimum(jnp.exp(logq[:, :-1]), jax.nn.softmax(target, axis=-1))
        return nll.mean(axis=1), greedy, sampled.sum(-1).mean(axis=1), counts

    def make_step(self, optimizer, bias_rate: float):
        jax = self.jax

        def loss(params, frozen, batch):
            rows, _, _, counts = self.row_losses(params, frozen, batch)
            return rows.mean(), (rows, counts)

        def step(params, opt_state, frozen, batch, lr):
            (_, (rows, counts)), grads = jax.value_and_grad(loss, has_aux=True)(params, frozen,
                                                                                batch)
            opt_state.hyperparams["learning_rate"] = lr
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
            layer = balance_routers({self.name: params["layer"]}, [self.name], counts, bias_rate)
            return {**params, "layer": layer[self.name]}, opt_state, rows, counts

        return jax.jit(step, donate_argnums=(0, 1))

    def evaluate(self, params, heldout: dict, batch_rows: int) -> dict:
        """Per domain, over non-overlapping held-out windows of seq + 2 tokens: the MTP loss and
        the greedy and sampled acceptance of a one-token draft, teacher-forced."""
        fn = self.jax.jit(self.row_losses)
        out = {}
        for d, s in heldout.items():
            n = (len(s) - 2) // self.seq
            windows = np.stack([s[i * self.seq:(i + 1) * self.seq + 2]
                                for i in range(n)]).astype(np.int32)
            got = []
            for i in range(0, n, batch_rows):
                chunk = windows[i:i + batch_rows]
                pad = batch_rows - len(chunk)
                rows = fn(params, self.frozen,
                          np.concatenate([chunk, np.repeat(chunk[:1], pad, 0)]))[:3]
                got.append(np.stack([np.asarray(r)[:len(chunk)] for r in rows]))
            loss, greedy, sampled = np.concatenate(got, axis=1).mean(axis=1)
            out[d] = {"loss": float(loss), "greedy_acceptance": float(greedy),
                      "sampled_acceptance": float(sampled)}
        return out

    def checkpoint_layer(self, params) -> dict:
        """The trained layer as decoder.mtp_specs declares it: the routed experts by id."""
        f = self.cfg.moe_intermediate_size
        gate_up, down = np.asarray(params["experts"]["gate_up"]), np.asarray(params["experts"]["down"])
        experts = {str(e): {"gate_proj": gate_up[e, :f], "up_proj": gate_up[e, f:],
                            "down_proj": down[e]} for e in range(self.cfg.n_routed_experts)}
        layer = self.jax.tree.map(np.asarray, params["layer"])
        return {self.name: layer | {"moe": layer["moe"] | {"experts": experts}}}


def train_mtp(args) -> None:
    import jax

    domains, streams, heldout = load_streams(args.data)
    trainer = MTPTrainer(args.model, args.seq, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    log(f"jax {jax.__version__} on {jax.devices()[0].platform}; MTP layer {trainer.name} of "
        f"{args.model}: {n_params / 1e6:.2f} M parameters (main model frozen); domains {domains}; "
        f"batch {args.rows_per_domain} x {len(domains)} x {args.seq}")
    optimizer = adamw(args.lr, args.weight_decay)
    opt_state = optimizer.init(trainer.params)
    train_step = trainer.make_step(optimizer, args.bias_rate)
    rng = np.random.default_rng(args.seed)
    params, total, step, history = trainer.params, args.steps, 0, []
    start = time.perf_counter()
    while step < total:
        lr = cosine_lr(step, total, args.lr, args.warmup)
        batch = balanced_batch(streams, domains, args.rows_per_domain, args.seq + 1, rng)
        params, opt_state, rows, _ = train_step(params, opt_state, trainer.frozen, batch,
                                                np.float32(lr))
        step += 1
        if args.minutes and step == 3:  # compiled and warm: size the run to the time budget
            jax.block_until_ready(rows)
            timed = time.perf_counter()
        if args.minutes and step == 6:
            jax.block_until_ready(rows)
            per_step = (time.perf_counter() - timed) / 3
            budget = args.minutes * 60 - (time.perf_counter() - start)
            total = max(step + 1, min(args.steps, step + int(budget / per_step)))
            log(f"{per_step:.2f} s/step -> {total} steps in {args.minutes} min")
        if step % args.log_every == 0 or step == total:
            r = np.asarray(rows).reshape(len(domains), -1).mean(axis=1)
            history.append({"step": step, "loss": float(r.mean()), **dict(zip(domains, map(float, r)))})
            log(f"step {step:5d}/{total}  lr {lr:.2e}  MTP loss {r.mean():.3f}  "
                + "  ".join(f"{d} {x:.2f}" for d, x in zip(domains, r))
                + f"  {time.perf_counter() - start:.0f}s")
    held = trainer.evaluate(params, heldout, args.rows_per_domain * len(domains))
    for d, x in held.items():
        log(f"held-out {d:7s} MTP loss {x['loss']:.3f}  acceptance (k = 1, teacher-forced): "
            f"greedy {x['greedy_acceptance']:.3f}  sampled (temperature 1) "
            f"{x['sampled_acceptance']:.3f}")
    export(trainer.frozen, trainer.cfg,
           trainer.raw_cfg, args.out, args.model, args.shard_mb, mtp=trainer.checkpoint_layer(params))
    main_log = args.model / "training_log.json"
    previous = json.loads(main_log.read_text()) if main_log.exists() else {}
    (args.out / "training_log.json").write_text(json.dumps(previous | {"mtp": {
        "history": history, "heldout": held,
        "args": {k: str(v) for k, v in vars(args).items()}}}, indent=1) + "\n")
