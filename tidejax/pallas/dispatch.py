"""Which implementation of a kernel runs: chosen per op by the caller's `impl` and the platform."""

from __future__ import annotations

import logging

import jax

log = logging.getLogger("tidejax.pallas")

IMPLS = ("auto", "pallas", "reference")
_logged: set[tuple[str, str]] = set()


def choose_impl(op: str, impl: str, fits=None) -> str:
    """"auto" -> "pallas" on a GPU backend when `fits()` (shapes the kernel takes; default yes),
    "reference" otherwise; logs each op's choice once."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r}, expected one of {IMPLS}")
    backend = jax.default_backend()
    why = f"backend {backend}"
    if impl == "auto":
        impl = "pallas" if backend == "gpu" else "reference"
        if impl == "pallas" and fits is not None and not fits():
            impl, why = "reference", f"backend {backend}, shapes the kernel does not take"
    if (op, impl) not in _logged:
        _logged.add((op, impl))
        log.info("%s: using the %s implementation (%s)", op, impl, why)
    return impl


def dispatch(op: str, impl: str, fits, reference, kernel, *args, **kwargs):
    """Runs `op` on the implementation `choose_impl(op, impl, fits)` picks, under a named scope:
    reference(*args, **kwargs), or kernel(*args, **kwargs, interpret=True off the GPU)."""
    impl = choose_impl(op, impl, fits)
    with jax.named_scope(f"{op}_{impl}"):
        if impl == "reference":
            return reference(*args, **kwargs)
        return kernel(*args, **kwargs, interpret=jax.default_backend() != "gpu")
