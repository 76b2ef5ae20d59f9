"""Which implementation of a kernel runs: chosen per op by the caller's `impl` and the platform."""

from __future__ import annotations

import logging

import jax

log = logging.getLogger("tidejax.pallas")

IMPLS = ("auto", "pallas", "reference")
_logged: set[tuple[str, str]] = set()


def choose_impl(op: str, impl: str) -> str:
    """"auto" -> "pallas" on a GPU backend, "reference" elsewhere; logs each op's choice once."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r}, expected one of {IMPLS}")
    backend = jax.default_backend()
    if impl == "auto":
        impl = "pallas" if backend == "gpu" else "reference"
    if (op, impl) not in _logged:
        _logged.add((op, impl))
        log.info("%s: using the %s implementation (backend %s)", op, impl, backend)
    return impl
