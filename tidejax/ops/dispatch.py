"""The one rule that picks an op's implementation, and the policy that sets it.

An implementation is "auto" (the Pallas kernel on a GPU backend when `fits()` says it takes the
shapes, the jnp reference otherwise), "pallas" (the kernel; interpret mode off the GPU) or
"reference". An op called with none takes the policy in force: `kernels(impl)` sets it for every
op called inside (a family's forward runs under its ServeOptions' kernel, the profile's
engine.kernel: tidejax.models.base.serving); "auto" outside any. The choice is made while
tracing, so a jitted function keeps the policy it was traced under.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import jax

log = logging.getLogger("tidejax.ops")

IMPLS = ("auto", "pallas", "reference")
# moe_grouped's kernel for prompt chunks (steps whose picks fill the Triton kernel's tiles:
# pallas.moe_prefill.fills_tiles): "pallas_dots" (moe_kernel's dots path, Pallas's deprecated
# Triton lowering) or "triton" (moe_prefill's grouped GEMM through jax-triton). A profile picks
# it (engine.moe_prefill, the engine's ServeOptions), a caller by `moe_grouped(prefill=...)`;
# MOE_PREFILL is only their default, "pallas_dots" until bench/kernels.py --prefill has timed
# both on a GPU.
MOE_PREFILL_KERNELS = ("pallas_dots", "triton")
MOE_PREFILL = "pallas_dots"
# an mHC site's front half on a GPU (ops.mhc_front where the policy lets it take kernels): "chain"
# (the jnp mixes and collapse around ops.sinkhorn's kernel) or "fused" (pallas.mhc's two Triton
# kernels). A profile picks it (engine.mhc_front, the model's ServeOptions); MHC_FRONT is the
# default, "chain" until bench/v41_parts.py --parts mhc has timed the fused form on a GPU.
MHC_FRONTS = ("chain", "fused")
MHC_FRONT = "chain"
_mhc_front: contextvars.ContextVar[str] = contextvars.ContextVar("tidejax_ops_mhc_front",
                                                                 default=MHC_FRONT)
_policy: contextvars.ContextVar[str] = contextvars.ContextVar("tidejax_ops_kernels",
                                                               default="auto")
_logged: set[tuple[str, str]] = set()


def _checked(op: str, impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r}, expected one of {IMPLS}")
    return impl


@contextlib.contextmanager
def kernels(impl: str):
    """The ops called inside (those given no `impl`) run on `impl`: "auto" | "pallas" |
    "reference"."""
    token = _policy.set(_checked("kernels", impl))
    try:
        yield
    finally:
        _policy.reset(token)


@contextlib.contextmanager
def mhc_front_form(form: str):
    """ops.mhc_front calls inside (those given no `impl`) take `form`: "chain" (the reference
    mixes around ops.sinkhorn, on any backend) | "fused" (the kernels where the policy in force
    takes them)."""
    if form not in MHC_FRONTS:
        raise ValueError(f"mhc_front: form={form!r}, expected one of {MHC_FRONTS}")
    token = _mhc_front.set(form)
    try:
        yield
    finally:
        _mhc_front.reset(token)


def mhc_front_in_force() -> str:
    return _mhc_front.get()


def policy() -> str:
    """The implementation in force for an op given none."""
    return _policy.get()


def choose_impl(op: str, impl: str | None = None, fits=None) -> str:
    """"auto" -> "pallas" on a GPU backend when `fits()` (shapes the kernel takes; default yes),
    "reference" otherwise; None -> the policy in force. Logs each op's choice once."""
    impl = _checked(op, policy() if impl is None else impl)
    backend = jax.default_backend()
    why = f"backend {backend}"
    if impl == "auto":
        impl = "pallas" if backend == "gpu" else "reference"
        if impl == "pallas" and fits is not None and not fits():
            impl, why = "reference", f"backend {backend}, shapes the kernel does not take"
    log_choice(op, impl, why)
    return impl


def log_choice(op: str, impl: str, why: str) -> None:
    """Logs `op`'s choice of `impl` the first time it is made."""
    if (op, impl) not in _logged:
        _logged.add((op, impl))
        log.info("%s: using the %s implementation (%s)", op, impl, why)


def run(op: str, impl: str | None, fits, reference, kernel, *args, **kwargs):
    """Runs `op` on the implementation `choose_impl(op, impl, fits)` picks, under a named scope:
    reference(*args, **kwargs), or kernel(*args, **kwargs, interpret=True off the GPU)."""
    impl = choose_impl(op, impl, fits)
    with jax.named_scope(f"{op}_{impl}"):
        if impl == "reference":
            return reference(*args, **kwargs)
        return kernel(*args, **kwargs, interpret=jax.default_backend() != "gpu")
