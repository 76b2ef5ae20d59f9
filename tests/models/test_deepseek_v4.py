"""DeepSeek-V4 against transformers' implementation on tiny random checkpoints written here, served
by the engine (tidejax.load: declared params, the checkpoint table, routed experts through
residency, compressed entries and indexer keys in the KV page pool, rings per lane): every
attention kind (sliding, CSA with its overlapping compressors and indexer, HCA), hash routing,
clamped SwiGLU, mHC with the hyper head, YaRN on the compress RoPE (or not); preempted requests
resume exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tidejax  # noqa: E402
from tidejax.errors import CheckpointError  # noqa: E402
from tidejax.kv.paged import PagedCache  # noqa: E402
from tidejax.models.deepseek_v4.config import V4Config  # noqa: E402
from tidejax.models.deepseek_v4.model import DeepseekV4, V4Lanes, V4Pages  # noqa: E402
from tidejax.models.deepseek_v4.weights import checkpoint_table, expert_specs, param_specs  # noqa: E402
from tidejax.residency.serve import ServeOptions  # noqa: E402
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent  # noqa: E402
from tests.support.declaration import (check_forward_on_declared, edited_copy, forbid_data_reads,
                                       param_paths)  # noqa: E402
from tests.support.tiny_models import lower_index_ties, write_tokenizer  # noqa: E402

VOCAB = 300  # the test tokenizer's byte-level alphabet and specials fit
CONFIGS = {
    "yarn_hc3": dict(hidden_size=64, head_dim=32, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=6,
                     index_topk=3, swiglu_limit=1.0, compress_rates={"compressed_sparse_attention": 4,
                                                                      "heavily_compressed_attention": 8},
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 64}),
    "plain_hc2": dict(hidden_size=48, head_dim=64, hc_mult=2, hc_sinkhorn_iters=20, sliding_window=9,
                      index_topk=4, swiglu_limit=7.0, compress_rates={"compressed_sparse_attention": 2,
                                                                       "heavily_compressed_attention": 16}),
}
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# three layers (small compiles), every attention kind, the first two hash-routed: between the
# two configs each compressed kind meets both routings and follows the other kind
LAYERS = {"yarn_hc3": [SLIDING, HCA, CSA], "plain_hc2": [SLIDING, CSA, HCA]}
ENGINE = {"lanes": 2, "max_context": 64, "prefill_chunk": 16, "kernel": "reference"}


def hf_config(name):
    return transformers.DeepseekV4Config(
        vocab_size=VOCAB, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=32,  # few heads: tied index scores (lower_index_ties)
        partial_rotary_factor=0.25, layer_types=LAYERS[name],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, **CONFIGS[name])


def write_tiny(path, name, seed):
    """A DeepseekV4ForCausalLM checkpoint (random, float32; save_pretrained) and a tokenizer;
    returns the torch model (eval mode) for reference outputs."""
    torch.manual_seed(seed)
    cfg = hf_config(name)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # every parameter random and O(1) in effect (the defaults zero many)
        for pname, p in model.named_parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3)
            if "norm" in pname:
                p.add_(1.0)
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif bname.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, VOCAB)
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """served(name) -> (path, torch model, engine): each config's checkpoint written and loaded
    once for the module, shared by the tests of every config and those of one."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            model = write_tiny(path, name, seed=len(name))
            made[name] = path, model, tidejax.load(path, engine=ENGINE)
        return made[name]
    return get


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, served):
    return served(request.param)


def prompt(seed: int, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def test_declared_params_are_what_the_model_consumes():
    """The model reads every declared param and runs on params from init(specs)
    (declaration.check_forward_on_declared), and the checkpoint table names a tensor for every
    declared param (the published name first).
    One config, yarn_hc3: both have the same params, but for their sizes (hc_mult 3 is the one
    a size fixed at 2 would not fit); plain_hc2's sizes are checked where it loads."""
    cfg = V4Config.from_hf(hf_config("yarn_hc3").to_dict())
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA} and cfg.hash_layers == (0, 1)
    tokens = jnp.zeros((1, 4), jnp.int32)
    serve = ServeOptions(kernel="reference", swiglu_limit=cfg.swiglu_limit, all_resident=True)
    declared = param_specs(cfg, jnp.float32)
    check_forward_on_declared(
        DeepseekV4(cfg, serve, jnp.float32), declared, expert_specs(cfg, jnp.float32),
        cfg.num_layers,
        (tokens, tokens, tokens > -1,
         PagedCache(V4Pages.create(cfg, 1, cfg.page_multiple), V4Lanes.create(cfg, 1)),
         jnp.zeros((1, 1), jnp.int32)))
    table = checkpoint_table(cfg)
    for path in param_paths(declared):
        names = table.param_names(path)
        assert names and not names[0].startswith("model."), path


def test_dense_params_follow_the_model_dtype():
    """In a bfloat16 model the dense params are bfloat16, but what transformers keeps in float32
    (`_keep_in_fp32_modules_strict`: norms, mHC and the hyper head, sinks, position biases) and
    the routers."""
    from tests.support.declaration import check_dense_dtypes

    def keeps(path):
        return ("_hc_" in path[0] or path[0].startswith("hc_head_") or "norm" in "".join(path)
                or path[-1] in ("sinks", "position_bias", "gate_weight", "gate_bias"))

    for name in CONFIGS:
        check_dense_dtypes(param_specs(V4Config.from_hf(hf_config(name).to_dict()),
                                       jnp.bfloat16), keeps)


def test_served_family_and_cache(tiny):
    """The pool holds the entries of the CSA layers (with their index keys) and the HCA layers
    (float32), one per rate positions; a lane keeps every layer's window ring and the
    compressors' rings, whatever max_context."""
    _, _, engine = tiny
    cfg = engine.cfg
    csa, hca, k, ik = cfg.csa_rate, cfg.hca_rate, cfg.head_dim, cfg.index_head_dim
    kinds = cfg.layer_types
    n_csa, n_hca = kinds.count(CSA), kinds.count(HCA)
    assert engine.family.name == "deepseek_v4"
    assert engine.cache_bytes_per_token() == 4 * (n_csa * (k + ik) / csa + n_hca * k / hca)
    rings = n_csa * (2 * csa) * (2 * k) * 2 + n_hca * hca * k * 2 + n_csa * (2 * csa) * (2 * ik) * 2
    assert engine.lane_bytes() == 4 * (len(kinds) * (cfg.sliding_window - 1) * k + rings)
    pages = engine.state.cache.pages
    for i in range(cfg.num_layers):
        for leaf in (pages.entries[i], pages.index_keys[i]):
            if leaf is not None:
                assert leaf.shape[:2] == (engine.loaded.kv_pages, engine.loaded.page_size // cfg.rate(i))
    assert [leaf is not None for leaf in pages.entries] == [kind != SLIDING for kind in kinds]
    assert [leaf is not None for leaf in pages.index_keys] == [kind == CSA for kind in kinds]


def test_logits_match_transformers(tiny):
    """With 2 index heads the k-th place of the indexer's pick is a tie somewhere (the choice
    torch leaves open, lower_index_ties): the parity covers the tie rule."""
    _, model, engine = tiny
    ids = prompt(0)
    with torch.no_grad(), lower_index_ties() as tied:
        want = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = engine.logits(ids)
    assert np.abs(got - want).max() <= 1e-4
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    assert sum(tied) > 0


def test_prefill_then_decode_equals_full_forward(tiny):
    """Prefill 11 (CSA and HCA windows left part full), then one token at a time through the
    pages (handed out of order) and the lane rings: the same logits as one forward (which matches
    transformers above)."""
    _, _, engine = tiny
    ids = prompt(4)
    want = engine.logits(ids)
    step = jax.jit(engine.loaded.module.apply)
    params, state = {"params": engine.loaded.params}, engine.state.experts
    n_pages = -(-40 // engine.loaded.page_size)
    cache, got = engine.loaded.new_cache(n_pages + 2, 1), []
    table = jnp.arange(n_pages, 0, -1, dtype=jnp.int32)[None]  # pages out of order, page 0 unused
    for lo, hi in [(0, 11)] + [(p, p + 1) for p in range(11, 40)]:
        pos = jnp.arange(lo, hi, dtype=jnp.int32)[None]
        logits, cache, state = step(params, jnp.asarray(ids[None, lo:hi]), pos, pos >= 0, cache,
                                    table, state)
        got.append(np.asarray(logits[0]))
    assert np.abs(np.concatenate(got) - want).max() <= 1e-4


def test_greedy_tokens_match_transformers(tiny):
    """Through the scheduler (16-token prefill chunks, two lanes) and through generate()."""
    _, model, engine = tiny
    text = "The tide comes in and the tide goes out."
    ids = engine.tokenizer.encode(text)
    with torch.no_grad(), lower_index_ties():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    outputs = {0: [], 1: []}
    for lane, request in enumerate([ids, prompt(5, 20).tolist()]):
        engine.scheduler.submit(
            GenerationRequest(request, 12, ignore_eos=True),
            lambda e, lane=lane: outputs[lane].append(e.token_id) if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    assert outputs[0] == want and len(outputs[1]) == 12
    stop = next((i for i, t in enumerate(want) if t in engine.eos_ids), len(want))
    assert engine.generate(text, max_new_tokens=12) == engine.tokenizer.decode(want[:stop])


@pytest.fixture(scope="module")
def small(served):
    """plain_hc2 in three lanes, a pool of 4 pages of 16 tokens."""
    path, _, _ = served("plain_hc2")
    return tidejax.load(path, engine={**ENGINE, "lanes": 3, "page_size": 16,
                                      "kv_pool_tokens": 64})


def greedy_of_full_forwards(engine, ids, got) -> list[int]:
    """One causal forward over prompt + tokens: position i's argmax is the greedy token after
    the first i + 1 tokens, so each generated token in `got` is checked against it."""
    logits = engine.logits(np.concatenate([ids, got]).astype(np.int32))
    return logits[len(ids) - 1:len(ids) - 1 + len(got)].argmax(-1).tolist()


def test_preempted_requests_resume_exactly(small):
    """Requests growing to 26, 28 and 30 positions need 6 pages of the pool's 4, so the newest
    is preempted (its pages, its lane's window and compressor rings to host memory) and resumes
    in whatever lane frees; every request's greedy tokens are those of full forwards."""
    prompts, new = [prompt(7, 10), prompt(8, 12), prompt(9, 14)], [16, 16, 16]
    out = [[] for _ in prompts]
    for i, (ids, n) in enumerate(zip(prompts, new)):
        small.scheduler.submit(
            GenerationRequest(ids.tolist(), n, ignore_eos=True),
            lambda e, i=i: out[i].append(e.token_id) if isinstance(e, TokenEvent) else None)
    small.scheduler.run_until_idle()
    stats = small.scheduler.kv_stats()
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0, stats
    for ids, n, got in zip(prompts, new, out):
        assert len(got) == n and got == greedy_of_full_forwards(small, ids, got)


def test_a_second_turn_restores_its_lane_from_a_snapshot(small):
    """Turn 1 (16 tokens: one page) generates 6; its chunk ends the page, so its lane's window
    and compressor rings are read to host memory with the page. Turn 2 (turn 1, its answer and
    5 new tokens) matches the page, has the snapshot written into its lane and prefills the 11
    tokens past turn 1; a 20-token prompt is chunked 16 and 4 (a chunk ends its full page) and
    the same prompt again prefills 4. Greedy tokens equal those of the cache off and of full
    forwards."""
    scheduler = small.scheduler

    def serve(ids, n):
        events, before = [], scheduler.totals["prefilled_tokens"]
        scheduler.submit(GenerationRequest(list(ids), n, ignore_eos=True), events.append)
        scheduler.run_until_idle()
        return ([e.token_id for e in events if isinstance(e, TokenEvent)],
                events[-1].stats["cached_tokens"], scheduler.totals["prefilled_tokens"] - before)

    first = prompt(10, 16).tolist()
    answer = serve(first, 6)[0]
    second = first + answer + prompt(11, 5).tolist()
    scheduler.caching = False
    try:
        uncached = serve(second, 6)
    finally:
        scheduler.caching = True
    got = serve(second, 6)
    assert uncached[1:] == (0, 27) and got[1:] == (16, 11)
    assert got[0] == uncached[0] == greedy_of_full_forwards(small, np.array(second), got[0])
    inside = prompt(12, 20).tolist()
    assert [len(ids) for _, ids in small.loaded.chunks(inside)] == [16, 4]
    runs = [serve(inside, 6) for _ in range(2)]
    assert [run[1:] for run in runs] == [(0, 20), (16, 4)]
    assert runs[1][0] == runs[0][0] == greedy_of_full_forwards(small, np.array(inside), runs[0][0])


def test_half_resident_exact_equals_all_resident(served):
    """Half the experts in the bank, misses copied in from the host pool: the same logits and
    greedy text. One config: both route alike (8 experts, top 2, layers 0 and 1 hash-routed, 2
    by its router); what tells them apart (mHC width, YaRN, rates, windows) is not residency's."""
    path, _, engine = served("plain_hc2")
    ids = prompt(6)
    n_layers, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    # 64-token chunks: residency's calibration (one chunk of text) scores in the shape of `ids`
    # (one compile less); the 14-token prompt below prefills in the same 16-token bucket
    half = tidejax.load(path, engine={**ENGINE, "prefill_chunk": 64}, residency={
        "budget_experts": n_layers * n_experts // 2, "miss_policy": "exact"})
    np.testing.assert_array_equal(half.logits(ids), engine.logits(ids))
    assert half.residency.stats()["misses"] > 0
    text = "def add(a, b):"
    assert half.generate(text, max_new_tokens=8) == engine.generate(text, max_new_tokens=8)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.attn.indexer.wq_b.weight"),
     r"missing tensor 'layers.1.attn.indexer.wq_b.weight' \(needed for params "
     r"\('layers_1_self_attn', 'compressor', 'indexer', 'q_b_proj', 'weight'\)\)"),
    (lambda t: t.pop("model.layers.2.ffn.experts.5.w2.weight"),
     r"missing tensor 'layers.2.ffn.experts.5.w2.weight' \(needed for routed expert\(s\) 5 of "
     r"layer 'layers.2.ffn'\)"),
    (lambda t: t.update({"model.layers.0.attn.extra.weight": np.zeros(3, np.float32)}),
     r"no rule maps: 'model.layers.0.attn.extra.weight' in .*model.safetensors"),
    (lambda t: t.update({"model.layers.2.attn.attn_sink": np.zeros(5, np.float32)}),
     r"tensor 'model.layers.2.attn.attn_sink' has shape \[5\], params "
     r"\('layers_2_self_attn', 'sinks'\) expects \[4\]"),
    (lambda t: t.update({"model.layers.1.ffn.experts.3.w1.weight": np.zeros((3, 3), np.float32)}),
     r"tensor 'model.layers.1.ffn.experts.3.w1.weight' has shape \[3, 3\], the routed experts' "
     r"'gate' of layer 'layers.1.ffn' expects \[32, "),
])
def test_bad_checkpoint_fails_at_load_naming_file_and_tensor(served, tmp_path, edit, message,
                                                             monkeypatch):
    """Every problem is found on the headers, before any tensor data is read. One config (its
    CSA layer is layer 1): the checks are the checkpoint table's, alike for both."""
    path, _, _ = served("plain_hc2")
    edited = edited_copy(path, tmp_path / "edited", edit)
    forbid_data_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=message) as err:
        tidejax.load(edited, engine=ENGINE)
    assert str(edited / "model.safetensors") in str(err.value)


def test_routing_replay_reaches_every_layer(served):
    """A replay of experts (0, 1) for every token routes every layer by it, the hash layers too:
    the demand counters move for those two experts only. One config: both have the same routed
    and hash-routed layers."""
    _, _, engine = served("plain_hc2")
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    k = engine.cfg.num_experts_per_tok
    before = np.asarray(engine.state.experts.counts).copy()
    engine.set_routing_replay(np.broadcast_to(np.arange(k, dtype=np.int32), (16, n_moe, k)))
    try:
        engine.logits(prompt(0)[:16])
    finally:
        engine.set_routing_replay(None)
    delta = np.asarray(engine.state.experts.counts) - before
    assert delta.shape == (n_moe, n_experts)
    assert (delta[:, k:] == 0).all() and (delta[:, :k] > 0).all(), delta
