"""Scratch (untracked, deleted after use): paged_mla_decode on the H200 at DeepSeek-V3 shapes."""
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp
import numpy as np

import attention as A

OUT = os.environ.get("OUT", "/tmp")
log = open(os.path.join(OUT, "attn.md"), "a")


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log.write(s + "\n")
    log.flush()


H, C, R, PS, SCALE = 128, 512, 64, 64, 0.1352
MODE = sys.argv[1] if len(sys.argv) > 1 else "sweep"
SHAPES = ((1, 4096), (1, 32768), (4, 4096), (4, 32768))
CEIL_N = 256 * 1024 * 1024
if MODE == "dry":  # CPU: tiny shapes, interpret mode
    import functools
    H, C, R, PS = 16, 32, 16, 8
    SHAPES = ((1, 64), (1, 256), (4, 64), (4, 256))
    CEIL_N = 1 << 20
    A.paged_mla_decode_pallas = functools.partial(A.paged_mla_decode_pallas, interpret=True)


def median_seconds(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def per_call(fn, q, qr, lat, rope, tables, lengths, n_iter):
    sets = tables.shape[0]

    def body(j, acc):
        return acc + fn(q, qr, lat, rope, tables[j % sets], lengths)

    loop = jax.jit(lambda acc: jax.lax.fori_loop(0, n_iter, body, acc))
    return median_seconds(loop, jnp.zeros(q.shape, jnp.float32)) / n_iter


def make(b, L, q_dtype=jnp.bfloat16, seed=0):
    P = L // PS
    set_bytes = b * P * PS * (C + R) * 2
    sets = max(2, math.ceil((256e6 if MODE != 'dry' else 1e5) / set_bytes))
    n_pages = sets * b * P
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    lat = jax.random.normal(k1, (n_pages, PS, C), jnp.bfloat16)
    rope = jax.random.normal(k2, (n_pages, PS, R), jnp.bfloat16)
    q = (jax.random.normal(k3, (b, H, C), jnp.float32) / C**0.5).astype(q_dtype)
    qr = (jax.random.normal(k4, (b, H, R), jnp.float32) / R**0.5).astype(q_dtype)
    rng = np.random.default_rng(seed)
    tables = jnp.asarray(rng.permutation(n_pages).reshape(sets, b, P).astype(np.int32))
    return q, qr, lat, rope, tables, jnp.full((b,), L, jnp.int32)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


ref = jax.jit(lambda *a: A.paged_mla_decode_reference(*a, scale=SCALE))
say(f"## paged_mla_decode on {jax.devices()[0].device_kind}, jax {jax.__version__}, mode {MODE}")

# read ceiling: sums of 512 MiB bf16 halves, alternating
big = jnp.ones((2, CEIL_N), jnp.bfloat16)
read = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda j, c: c + jnp.sum(a[j % 2], dtype=jnp.float32), 0.0))
ceiling = big[0].nbytes / (median_seconds(read, big) / 20) / 1e9
say(f"HBM read ceiling (jnp.sum over 512 MiB bf16): {ceiling:.0f} GB/s")
del big


SWEEP = {
    (1, 32768): [((16, 64, 4, 2), None, False), ((16, 64, 4, 2), None, True), ((16, 32, 4, 2), None, False),
                 ((16, 32, 4, 3), None, False), ((16, 32, 4, 4), None, False), ((32, 32, 4, 3), None, False),
                 ((64, 32, 8, 2), None, False), ((32, 64, 4, 2), None, False), ((16, 16, 4, 4), None, False),
                 ((16, 32, 4, 3), 66, False)],
    (4, 32768): [((16, 64, 4, 2), None, False), ((16, 32, 4, 3), None, False), ((32, 32, 4, 3), None, False),
                 ((16, 32, 4, 4), None, False), ((64, 32, 8, 2), None, False)],
    (1, 4096): [((16, 64, 4, 2), None, False), ((16, 32, 4, 3), None, False), ((16, 32, 4, 4), None, False)],
    (4, 4096): [((16, 64, 4, 2), None, False), ((16, 32, 4, 3), None, False), ((16, 32, 4, 4), None, False)],
}
say("\n| b | L | tile (bh, bs, warps, stages) | rows | splits | us | GB/s | x ceiling | TFLOP/s |")
say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (b, L), cands in (SWEEP.items() if MODE != "dry" else zip(SHAPES, SWEEP.values())):
    q, qr, lat, rope, tables, lengths = make(b, L)
    nbytes = b * L * (C + R) * 2
    flops = b * L * H * (2 * (C + R) + 2 * C)
    best = None
    for tile, sp, gather in cands:
        A.FORCE_GATHER = gather
        try:
            s = per_call(lambda *a: A.paged_mla_decode_pallas(*a, scale=SCALE, tile=tile, splits=sp),
                         q, qr, lat, rope, tables, lengths, 50)
        except Exception as e:  # noqa: BLE001
            say(f"| {b} | {L} | {tile} | | {sp} | failed: {type(e).__name__}: {str(e)[:200]} | | | |")
            continue
        finally:
            A.FORCE_GATHER = False
        used = sp or A.choose_splits(b, H // min(tile[0], H), L // tile[1])
        rows = "gather" if gather or tile[1] > PS else "block"
        say(f"| {b} | {L} | {tile} | {rows} | {used}{'' if sp else ' (auto)'} | {s*1e6:.1f} | {nbytes/s/1e9:.0f} | "
            f"{nbytes/s/1e9/ceiling:.2f} | {flops/s/1e12:.0f} |")
        if not gather and (best is None or s < best[0]):
            best = (s, tile, sp)
    if b == 4:
        s = per_call(ref, q, qr, lat, rope, tables, lengths, 10)
        say(f"| {b} | {L} | reference (jit) | | - | {s*1e6:.1f} | {nbytes/s/1e9:.0f} | {nbytes/s/1e9/ceiling:.2f} | "
            f"{flops/s/1e12:.0f} |")
    say(f"best b={b} L={L}: {best[1]} splits {best[2]} {best[0]*1e6:.1f} us")
    if L == SHAPES[-1][1] and b == 4 or (b, L) == SHAPES[0]:
        if b == 4:
            lengths = jnp.asarray([L, L - 37, 1, 0], jnp.int32)
        for qd in (jnp.bfloat16, jnp.float32):
            args = (q.astype(qd), qr.astype(qd), lat, rope, tables[0], lengths)
            got = A.paged_mla_decode_pallas(*args, scale=SCALE, tile=best[1], splits=best[2])
            say(f"check b={b} L={L} tile {best[1]} lengths={list(map(int, lengths))} q {jnp.dtype(qd).name}: "
                f"rel err {rel(got, ref(*args)):.2e}, zeros row ok {bool(b == 1 or np.all(np.asarray(got[3]) == 0))}")
    del q, qr, lat, rope, tables
