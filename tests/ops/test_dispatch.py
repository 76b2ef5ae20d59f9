"""The one rule that picks an op's implementation (tidejax/ops/dispatch.py) and the policy that
sets it for the ops called with none."""

from __future__ import annotations

import pytest


def test_an_op_given_no_impl_takes_the_policy_in_force(monkeypatch):
    """ops.kernels sets the implementation of the ops called inside it with none (a family's
    forward: its ServeOptions' kernel); an impl given wins; outside any, "auto"."""
    from tidejax import ops
    from tidejax.ops import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.choose_impl("moe_grouped") == "pallas"
    with ops.kernels("reference"):
        assert dispatch.choose_impl("moe_grouped") == "reference"
        assert dispatch.choose_impl("moe_grouped", "pallas") == "pallas"
        with ops.kernels("auto"):
            assert dispatch.choose_impl("moe_grouped", fits=lambda: False) == "reference"
        assert dispatch.choose_impl("moe_grouped") == "reference"
    assert dispatch.policy() == "auto"
    with pytest.raises(ValueError, match="impl='cuda'"):
        with ops.kernels("cuda"):
            pass
