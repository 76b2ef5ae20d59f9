"""A profile's engine.mhc_front reaches the served forward: the V4.1 engine's mHC sites are
traced under the form it names (ops.mhc_front_form, entered by models.base.serving from the
module's ServeOptions), "chain" by default."""

import pytest

import tidejax
from tidejax import ops
from tidejax.ops import dispatch


@pytest.mark.parametrize("form", [None, "fused"])
def test_the_profiles_mhc_front_is_the_form_the_forward_runs(v41, monkeypatch, form):
    seen = []
    front = ops.mhc_front

    def noted(*args, **kwargs):
        seen.append(dispatch.mhc_front_in_force())
        return front(*args, **kwargs)

    monkeypatch.setattr(ops, "mhc_front", noted)
    engine = tidejax.load(v41, engine={"lanes": 1, "max_context": 32, "page_size": 16,
                                       "prefill_chunk": 16, "warmup": False,
                                       **({"mhc_front": form} if form else {})})
    assert engine.loaded.module.serve.mhc_front == (form or "chain")
    engine.generate(["the tide"], max_new_tokens=2)
    assert seen and set(seen) == {form or "chain"}
