"""The device's limits, measured in the same run as the figures divided by them.

Every roofline in bench/ divides by `hbm_read_gbps()`: bytes a read-only kernel streams from HBM a
second. A decode step only reads its weights, so a copy (which reads and writes) or a jitted
`a + 1` (2.8-3.0 TB/s on the H200 against 4.49 read) would flatter it. `copy_gbps()` is reported
beside it for comparison with older figures.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

READ_LANES = 16  # partial sums a program writes (Triton blocks are powers of two, not scalars)
READ_CONFIGS = [(block, warps) for block in (1 << 13, 1 << 14, 1 << 15, 1 << 16) for warps in (4, 8)]


def median_seconds(fn, *args, reps: int = 7) -> float:
    """Median wall seconds of `fn(*args)` after one call that compiles and warms."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds_per_step(step, carry, *args, n_iter: int, on_compile=None) -> float:
    """Median seconds of one `carry = step(j, carry, *args)`, from loops of n_iter in one jit (so
    dispatch does not count), compiled once; `on_compile(executable)` is called with the compiled
    loop before it runs."""
    loop = jax.jit(lambda c, *a: jax.lax.fori_loop(0, n_iter, lambda j, c: step(j, c, *a), c))
    loop = loop.lower(carry, *args).compile()
    if on_compile is not None:
        on_compile(loop)
    return median_seconds(loop, carry, *args, reps=5) / n_iter


def _read_all(x, salt, block: int, warps: int):
    """Partial sums of x (float32 [n], n a multiple of block), plus salt [READ_LANES]: every byte
    read once, READ_LANES values a block written back. The salt (the loop index) keeps XLA from
    hoisting the call out of a loop."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, salt_ref, o_ref):
        o_ref[...] = jnp.sum(x_ref[...].reshape(READ_LANES, block // READ_LANES), axis=1) + salt_ref[...]

    programs = x.shape[0] // block
    return pl.pallas_call(
        kernel, grid=(programs,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,)),
                  pl.BlockSpec((READ_LANES,), lambda i: (0,))],
        out_specs=pl.BlockSpec((READ_LANES,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((programs * READ_LANES,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))(x, salt)


def hbm_read_gbps(nbytes: int = 1 << 30) -> float:
    """HBM read bandwidth, GB/s: the best of XLA's sum over `nbytes` of float32 and, for each of
    READ_CONFIGS (block, warps), a Pallas kernel that streams them and writes back a partial sum
    per block / READ_LANES values; each looped inside one jit (the loop carries the sums, so no
    iteration is skipped). On the H200 (2026-12-01): XLA's sum 4.09 TB/s, the kernel 3.80-4.01.
    Off the GPU, XLA's sum alone."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    seconds = seconds_per_step(lambda j, acc, x: acc + jnp.sum(x + j), jnp.float32(0), x, n_iter=20)
    best = nbytes / seconds / 1e9
    for block, warps in READ_CONFIGS if jax.default_backend() == "gpu" else ():  # Triton only
        def step(j, acc, x, block=block, warps=warps):
            salt = jnp.full((READ_LANES,), j, jnp.float32)
            return acc + _read_all(x, salt, block, warps)[:READ_LANES]

        seconds = seconds_per_step(step, jnp.zeros(READ_LANES, jnp.float32), x, n_iter=20)
        best = max(best, nbytes / seconds / 1e9)
    return best


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth, GB/s read + written by `v + 1` over `nbytes` of float32, looped
    inside one jit."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    seconds = seconds_per_step(lambda j, v: v + 1.0, x, n_iter=20)
    return 2 * nbytes / seconds / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """bf16 matmul TFLOP/s at n^3, looped inside one jit."""
    a = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    seconds = seconds_per_step(lambda j, c, p: p @ c, b, a, n_iter=10)  # c stays O(1): a ~orthogonal
    return 2 * n**3 / seconds / 1e12


def disk_read_gbps(row_bytes: int, rows: int = 0, folder: str | None = None) -> float:
    """Disk read GB/s of the disk tier's own reader (residency.disk.PreparedRows: one os.preadv
    a row into fresh arrays) over `rows` rows of `row_bytes` (default: 16 to 64, about 256 MiB)
    in a shuffled order, from a file written under `folder` (default: the temporary folder) and
    dropped from the page cache first (fsync, then POSIX_FADV_DONTNEED), so the reads come from
    the disk."""
    rows = rows or min(64, max(16, (256 << 20) // row_bytes))
    import os
    import tempfile

    import numpy as np

    from tidejax.residency.disk import PreparedRows

    layout = {"row": jax.ShapeDtypeStruct((rows, row_bytes), np.uint8)}
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = os.path.join(tmp, "rows.bin")
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 256, rows * row_bytes, np.uint8))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        reader = PreparedRows(path, layout)
        order = np.random.default_rng(1).permutation(rows)
        start = time.perf_counter()
        for row in order:
            reader.read(int(row))
        seconds = time.perf_counter() - start
        del reader
    return rows * row_bytes / seconds / 1e9
