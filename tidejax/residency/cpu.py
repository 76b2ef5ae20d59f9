"""The `cpu` miss policy: a MoE layer's missed picks computed on the host CPU, straight from the
host pool, while the device computes the resident picks; serve_routed sums the two parts on the
device.

    experts = CpuExperts(pool, n_experts)             # at boot: the placed pool, read in place
    y_host = experts.serve(moe_index, x, ids, weights, miss, swiglu_limit)   # inside the jit
    moe_host(views, x, rows, tokens, weights, swiglu_limit, isa)   # the host computation alone

Why this shape (measured on the H200 machine's host, 16 vCPUs, 2026-12-01; DESIGN.md "facts to
design with"): XLA:CPU runs an expert's bf16 GEMV at 2.5 GB/s and an MXFP4 dequantize-and-dot
at 1.2 GB/s, the same GEMV through `compute_on("device_host")` inside a GPU jit at 2.3 GB/s, a
parallel numba MXFP4 GEMV at 6 GB/s, while numpy's BLAS streams a float32 GEMV at 116 GB/s: the
host side has to be hand-written SIMD code. So the host part is a C extension (cpu_kernel.c,
built by setuptools from setup.py; no build dependency beyond a C compiler): e2m1 codes looked
up in a scaled 16-entry table by VPERMPS (AVX-512) or a VPSHUFB byte shuffle (AVX2), float32
FMAs with float32 activations, one expert row slice a thread on all CPUs but one, the ISA picked
at run time, numpy where the extension was not built. Measured there (bench/cpu_experts.py,
bench/RESULTS.md): MXFP4 experts of 5120 x 2304 at one token 57-74 GB/s on AVX-512 (1-6 experts),
38-48 on AVX2, 11-12 scalar, 0.07 numpy; 26-38 GB/s at 4 tokens an expert (compute bound); bf16
82-85 GB/s. A `jax.pure_callback` round trip costs ~123 us inside a GPU jit, so the device calls
the host once per MoE layer per step, with all of that layer's missed (token, expert, weight)
picks; its workers spin (yielding) 5 ms between jobs, since waking sleeping threads cost a 40-layer
step 19 ms. Decode at 62.5% resident on the 40-layer V3-family synthetic: 14.9 / 35.1 tok/s at
1 / 4 lanes, `exact` 15.7 / 34.4; ~1 ms a layer goes outside the kernel (the callback and the
stream sync it forces). On the CPU backend the step calls the kernel as an XLA custom call
instead (cpu_ffi.cc: no Python in the step, 0.008 ms a call against pure_callback's 0.32 on
this repository's 2-core CI machine); on a GPU it still goes through pure_callback. The host
reads the pool's own buffer (the pinned_host array every step carries) in place through a
view taken at boot: no copy of the experts, and no reference that would stop the step from
donating (aliasing) that buffer.

Accuracy: the host computes each pick in float32 with the same weights as the jnp reference
(MXFP4 values are exact: an e2m1 code times a power of two), so it differs from all-resident
only in the order of float32 sums (the dots over D and I, the sigmoid's last bits, the sum of
the resident and host parts). Each output element of the host part is within

    B = 2**-24 * sum_p |w_p| * ((I + k + 4) * (|down_p| @ |act_p|)
                               + D * (|down_p| @ (1.1 * |u_p| * G_p + |silu(g_p)| * U_p)))

of the exact value (the float32 dot bound carried through SwiGLU to first order; g_p, u_p the
gate and up values, G_p, U_p = |gate rows| @ |x|, |up rows| @ |x|, k the token's picks), and the
device's float32 reference obeys the same bound, so `cpu` and all-resident differ by at most 2B
plus one rounding of their sum; on random experts the differences are ~1e-6 of the output's
scale (tests/residency/test_cpu_policy.py checks B against float64).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.contract import BIAS_KEYS, bank_format, split_gate_up, swiglu
from tidejax.pallas.bank import bank_dims, dequantized

try:
    from tidejax.residency import _cpu_kernel
except ImportError:  # not built (no C compiler at install): the numpy path
    _cpu_kernel = None

log = logging.getLogger("tidejax.residency")

ISAS = ("scalar", "avx2", "avx512")  # the compiled paths, narrowest first
_KINDS = {"mxfp4": 0, "float32": 1, "bfloat16": 2}


def kernel_isa() -> str:
    """The path moe_host takes by default: "avx512", "avx2" or "scalar" (the extension), or
    "numpy" where the extension is not built."""
    return _cpu_kernel.best_isa() if _cpu_kernel else "numpy"


def kernel_threads() -> int:
    """Threads the compiled kernel runs on (the CPUs this process may use but one); 1 for numpy."""
    return _cpu_kernel.threads() if _cpu_kernel else 1


def available_isas() -> tuple[str, ...]:
    """Every path this machine can run, the numpy one included."""
    best = kernel_isa()
    return ("numpy",) + (ISAS[:ISAS.index(best) + 1] if best in ISAS else ())


def moe_host(views: dict, x: np.ndarray, rows: np.ndarray, tokens: np.ndarray,
             weights: np.ndarray, swiglu_limit: float = 0.0, isa: str | None = None) -> np.ndarray:
    """y [T, D] float32 = sum over picks p of weights[p] * down_r(swiglu(gate_up_r @ x[tokens[p]]))
    with r = rows[p], a row of the pool `views` (a bank-format dict of numpy arrays [N, ...]);
    x [T, D]; rows, tokens, weights [P]. isa: one of available_isas() (None: kernel_isa())."""
    isa = isa or kernel_isa()
    if isa not in available_isas():
        raise ValueError(f"isa={isa!r}: this machine runs {available_isas()}")
    n, d, inter = bank_dims(views)
    x = np.ascontiguousarray(x, np.float32)
    rows = np.ascontiguousarray(rows, np.int64)
    tokens = np.ascontiguousarray(tokens, np.int64)
    weights = np.ascontiguousarray(weights, np.float32)
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"moe_host: x has shape {x.shape}, expected [T, {d}]")
    if not rows.shape == tokens.shape == weights.shape or rows.ndim != 1:
        raise ValueError(f"moe_host: rows {rows.shape}, tokens {tokens.shape} and weights "
                         f"{weights.shape} must all be [P]")
    y = np.zeros(x.shape, np.float32)
    if not rows.size:
        return y
    if isa == "numpy":
        return _moe_numpy(views, x, rows, tokens, weights, swiglu_limit, y)
    kind, leaves = _kernel_leaves(views)
    _cpu_kernel.moe(ISAS.index(isa), _KINDS[kind], n, d, inter, x.shape[0], rows.size,
                    *leaves, x, rows, tokens, weights, float(swiglu_limit), y)
    return y


def _kernel_leaves(views: dict) -> tuple[str, tuple]:
    """The kernel's kind name and its four leaves (gate_up, gate_up_scales, down, down_scales;
    the scales None for dense experts) of a bank-format dict of numpy arrays."""
    if bank_format(views) == "mxfp4":
        return "mxfp4", (views["gate_up_blocks"], views["gate_up_scales"], views["down_blocks"],
                         views["down_scales"])
    kind = np.dtype(views["gate_up"].dtype).name
    if kind not in _KINDS:
        raise ValueError(f"cpu kernel: dense experts of {kind}; it takes float32 or bfloat16")
    return kind, (_as_bits(views["gate_up"]), None, _as_bits(views["down"]), None)


def _as_bits(a: np.ndarray) -> np.ndarray:
    """bfloat16 as its uint16 bits (the buffer protocol has no bfloat16); float32 as it is."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _moe_numpy(views, x, rows, tokens, weights, swiglu_limit, y):
    """moe_host without the extension: each distinct expert dequantized to float32 once."""
    out = np.empty((rows.size, x.shape[1]), np.float32)  # [P, D] per pick
    for row in np.unique(rows):
        picks = np.nonzero(rows == row)[0]
        w = dequantized({k: v[row:row + 1] for k, v in views.items()}, np.float32)
        h = x[tokens[picks]] @ w["gate_up"][0].T  # [n, 2I]
        out[picks] = swiglu(*split_gate_up(h), swiglu_limit) @ w["down"][0].T
    for p in range(rows.size):  # in pick order
        y[tokens[p]] += weights[p] * out[p]
    return y


def host_view(leaf: jax.Array) -> np.ndarray:
    """A read-only numpy view of a single-device jax array in host memory, in place (no copy, no
    reference held on its buffer: tidejax.parallel.host_buffer); a copy where the buffer cannot
    be read in place (logged: the pool is then held twice in host memory)."""
    try:
        view = parallel.host_buffer(leaf)
    except ValueError as e:
        log.warning("residency: the cpu policy keeps its own copy of the host pool (%s)", e)
        return np.asarray(leaf)
    view.flags.writeable = False
    return view


FFI_TARGET = "tidejax_cpu_misses"  # the custom call of cpu_ffi.cc
_ffi_platforms: set[str] = set()  # the platforms it is registered for in this process


def ffi_platform() -> str | None:
    """"cpu" where the custom call serves this process's default backend (registering it on
    first use): the CPU, with the extension built against XLA's FFI headers; None elsewhere
    (on a GPU the step calls the kernel through jax.pure_callback: cpu_ffi.cc says why)."""
    handler = _cpu_kernel.ffi_handler() if _cpu_kernel else None
    if handler is None or jax.default_backend() != "cpu":
        return None
    if "cpu" not in _ffi_platforms:
        jax.ffi.register_ffi_target(FFI_TARGET, handler, platform="cpu")
        _ffi_platforms.add("cpu")
    return "cpu"


class CpuExperts:
    """The host pool as the host kernel reads it and the count of picks it computed.

    pool: the placed host pool (bank-format dict of jax arrays [L_moe * E, ...]). Where the
    custom call is built (ffi_platform()) the step calls the kernel through it; otherwise (the
    numpy path, or no handler for the backend) through jax.pure_callback.

    Over the disk tier (`disk`: residency.hostcache.HostCache, whose pool [capacity, ...] this
    is) a pick's row is found through the step's map (ExpertState.host_slots): the custom call
    sees the cache's slots as the rows of one layer and takes each pick's slot as its expert id.
    A layer with a pick of a row on disk goes through the callback instead, which waits for
    that row's read (HostCache.read_now, as `exact`'s miss: queued already, or read there) and
    computes the layer's picks from the rows gathered in one buffer (a copy of the layer's
    missed rows, beside the wait for the disk); the sums are the kernel's, in pick order, so
    the output is the same bits as with every expert in host memory."""

    def __init__(self, pool: dict, n_experts: int, isa: str | None = None,
                 via: str = "custom_call", disk=None):
        """via: "custom_call" (where built, else the callback) or "callback" (jax.pure_callback,
        to compare the two: bench/cpu_experts.py); disk: the host cache `pool` is the pool of
        (None: the pool holds every row)."""
        if via not in ("custom_call", "callback"):
            raise ValueError(f"via={via!r}, expected 'custom_call' or 'callback'")
        n, d, inter = bank_dims(pool)  # checks the format
        if BIAS_KEYS & set(pool):
            raise ValueError("the cpu miss policy takes routed experts without biases (gpt-oss's "
                             "have them); use miss policy 'exact' or 'substitute'")
        self.n_experts, self.disk = n_experts, disk
        self.views = {k: host_view(pool[k]) for k in pool}
        self.isa = isa or kernel_isa()
        self._callback_picks = 0  # picks computed through pure_callback
        self._disk_picks = 0  # of those, picks of rows on disk when their step ran
        self.handle = None  # the registered pool the custom call reads
        self.platform = ffi_platform() if self.isa != "numpy" and via == "custom_call" else None
        if self.platform is not None:
            kind, leaves = _kernel_leaves(self.views)
            layer_rows = n if disk is not None else n_experts  # the cache's slots: one layer
            self.handle = _cpu_kernel.set_pool(ISAS.index(self.isa), _KINDS[kind], n, layer_rows,
                                               d, inter, *leaves)
        log.info("residency: misses computed on the host CPU (%s path, %d threads, %s)", self.isa,
                 kernel_threads() if self.isa != "numpy" else 1,
                 f"an XLA custom call on {self.platform}" if self.handle is not None
                 else "jax.pure_callback")

    @property
    def picks(self) -> int:
        """Picks computed on the host since boot."""
        kernel = 0 if self.handle is None else _cpu_kernel.pool_picks(self.handle)
        return kernel + self._callback_picks

    @property
    def disk_picks(self) -> int:
        """Picks computed on the host since boot whose row was on disk when their step ran
        (read inside the step: `disk`)."""
        return self._disk_picks

    def reads_in_place(self, pool: dict) -> bool:
        """Whether every view is the buffer of `pool`'s leaf (the state's pool now)."""
        return all(self.views[k].ctypes.data == pool[k].unsafe_buffer_pointer() for k in pool)

    def serve(self, moe_index: int, x, ids, weights, miss, swiglu_limit: float,
              host_slots=None):
        """Inside the jit: x [T, D], ids / weights [T, k], miss [T, k] bool -> y [T, D] float32,
        the weighted sum of the missed picks, computed on the host in one call. host_slots
        [L_moe * E]: the step's map of the host cache, over the disk tier."""
        args = (x.astype(jnp.float32), ids.astype(jnp.int32), weights.astype(jnp.float32), miss)
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        if self.disk is not None:
            return self._serve_cached(moe_index, *args, swiglu_limit, host_slots)
        if self.handle is not None:
            return jax.ffi.ffi_call(FFI_TARGET, out)(
                *args, pool=np.int64(self.handle), moe_index=np.int64(moe_index),
                swiglu_limit=np.float32(swiglu_limit))
        host = functools.partial(self._host, moe_index, float(swiglu_limit))
        return jax.pure_callback(host, out, *args)

    def _serve_cached(self, moe_index: int, x, ids, weights, miss, swiglu_limit: float,
                      host_slots):
        """`serve` over the disk tier (the class's docstring)."""
        if host_slots is None:
            raise ValueError("the cpu policy over the disk tier needs the step's host map "
                             "(ExpertState.host_slots)")
        rows = moe_index * self.n_experts + ids  # [T, k] pool rows
        at = host_slots[rows]  # [T, k] their host slots, -1 on disk
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        host = functools.partial(self._host_cached, float(swiglu_limit))
        callback = lambda: jax.pure_callback(host, out, x, rows, at, weights, miss)
        if self.handle is None:
            return callback()
        kernel = lambda: jax.ffi.ffi_call(FFI_TARGET, out)(
            x, at, weights, miss, pool=np.int64(self.handle), moe_index=np.int64(0),
            swiglu_limit=np.float32(swiglu_limit))
        return jax.lax.cond((miss & (at < 0)).any(), callback, kernel)

    def _host_cached(self, swiglu_limit, x, rows, at, weights, miss):
        tokens, ks = np.nonzero(np.asarray(miss))
        rows = np.asarray(rows)[tokens, ks].astype(np.int64)
        slots = np.asarray(at)[tokens, ks].astype(np.int64)
        views, on_disk = self.views, int((slots < 0).sum())
        if on_disk:
            views, slots = self._gathered(rows, slots)
        y = moe_host(views, x, slots, tokens, np.asarray(weights)[tokens, ks], swiglu_limit,
                     self.isa)
        self._callback_picks += rows.size
        self._disk_picks += on_disk
        return y

    def _gathered(self, rows: np.ndarray, slots: np.ndarray) -> tuple[dict, np.ndarray]:
        """The distinct `rows` [P] in one bank-format buffer, each from its host slot (`slots`
        [P]) or, on disk (-1), from the host cache's read, waiting for it; -> (the buffer, each
        pick's index into it)."""
        distinct, index = np.unique(rows, return_inverse=True)
        slot_of = dict(zip(rows.tolist(), slots.tolist()))
        parts = [self.disk.read_now(row) if slot_of[row] < 0
                 else {k: v[slot_of[row]] for k, v in self.views.items()}
                 for row in distinct.tolist()]
        return {k: np.stack([part[k] for part in parts]) for k in self.views}, index

    def _host(self, moe_index, swiglu_limit, x, ids, weights, miss):
        tokens, ks = np.nonzero(np.asarray(miss))
        rows = moe_index * self.n_experts + np.asarray(ids)[tokens, ks].astype(np.int64)
        y = moe_host(self.views, x, rows, tokens, np.asarray(weights)[tokens, ks], swiglu_limit,
                     self.isa)
        self._callback_picks += rows.size
        return y
