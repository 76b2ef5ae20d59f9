"""mHC's fused front (pallas.mhc: two Triton kernels, in Triton's interpreter on the CPU) against
its jnp reference, the kernels' launches counted, the dispatch's choice, and both kernels
compiled for Hopper (sm_90, on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax import ops
from tidejax.pallas import mhc as forms
from tidejax.pallas import sinkhorn as sinkhorn_forms

MIX = dict(eps=1e-6, hc_eps=1e-6, iters=20)  # DeepSeek-V4.1-Flash's


def site(rng, t: int, d: int, dtype, hc: int = 4):
    """Random streams [t, hc, d] and a site's (fn, base, scale), fn at the checkpoint's scale."""
    streams = jnp.asarray(rng.normal(0, 1, (t, hc, d)), dtype)
    fn = jnp.asarray(rng.normal(0, 0.02, ((2 + hc) * hc, hc * d)), jnp.float32)
    base = jnp.asarray(rng.normal(0, 1, ((2 + hc) * hc,)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2, (3,)), jnp.float32)
    return streams, fn, base, scale


@pytest.mark.parametrize("t,d,dtype,given", [
    (1, 256, jnp.bfloat16, False), (4, 256, jnp.float32, True), (37, 256, jnp.bfloat16, True),
    (37, 256, jnp.float32, False), (1, 4096, jnp.bfloat16, True)])
def test_the_kernels_compute_the_reference(rng, t, d, dtype, given):
    """Token counts under, at and over the kernels' blocks, V4.1's width at one token, collapsed
    by the site's pre (V4) and by a given one (V4.1). The mixes within float32 rounding; x, their sum over the
    streams, within that rounding in float32 (1e-6 failed once: 1.07e-6 apart on 0.053,
    seed 653541628) and within one bf16 step in bf16 (Triton's interpreter truncates to bf16
    where XLA rounds)."""
    streams, fn, base, scale = site(rng, t, d, dtype)
    pre_in = jnp.asarray(rng.uniform(0, 1, (t, 4)), jnp.float32) if given else None
    want = forms.mhc_front_reference(streams, fn, base, scale, pre_in, **MIX)
    got = jax.jit(lambda *a: ops.mhc_front(*a, impl="pallas", **MIX))(
        streams, fn, base, scale, pre_in)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert got[3].dtype == dtype
    step = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got[3], np.float32), np.asarray(want[3], np.float32),
                               rtol=step, atol=1e-5, err_msg="x")


def test_the_kernels_ran_and_not_the_reference(rng, monkeypatch):
    """impl="pallas" launches the two kernels, projection then finish, and calls neither
    reference."""
    launched = []

    def counted(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return launch(kernel, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("a reference ran")

    launch = forms.launch
    monkeypatch.setattr(forms, "launch", counted)
    monkeypatch.setattr(forms, "mhc_front_reference", refused)
    jax.block_until_ready(ops.mhc_front(*site(rng, 3, 64, jnp.bfloat16), impl="pallas", **MIX))
    assert launched == ["mhc_project_kernel", "mhc_finish_kernel"]


@pytest.mark.parametrize("form", ["chain", "fused"])
def test_the_form_in_force_picks_the_chain_or_the_kernels(rng, monkeypatch, form):
    """An op given no impl, under the "pallas" policy: the chain (the reference, its Sinkhorn on
    the kernel) unless the form in force is "fused" (a profile's engine.mhc_front)."""
    launched = []

    def counted(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return launch(kernel, *args, **kwargs)

    launch = forms.launch
    monkeypatch.setattr(forms, "launch", counted)
    monkeypatch.setattr(sinkhorn_forms, "sinkhorn_triton", counted_sinkhorn(launched))
    with ops.kernels("pallas"), ops.mhc_front_form(form):
        jax.block_until_ready(ops.mhc_front(*site(rng, 3, 64, jnp.bfloat16), **MIX))
    want = (["mhc_project_kernel", "mhc_finish_kernel"] if form == "fused"
            else ["sinkhorn_kernel"])
    assert launched == want
    with pytest.raises(ValueError, match="mhc_front"):
        ops.mhc_front_form("fast").__enter__()


def counted_sinkhorn(launched):
    """ops.sinkhorn's kernel form, its launch noted."""
    kernel = sinkhorn_forms.sinkhorn_triton

    def counted(*args, **kwargs):
        launched.append("sinkhorn_kernel")
        return kernel(*args, **kwargs)
    return counted


def test_auto_takes_the_kernels_only_where_they_fit(rng):
    """"auto" takes the kernels on a GPU, the reference elsewhere; they take hc <= MAX_HC, a
    site's fn (not the head's) and bf16 or float32 streams."""
    streams, fn, *_ = site(rng, 2, 64, jnp.bfloat16)
    fits = forms.triton_supports(streams, fn)
    want = "pallas" if jax.default_backend() == "gpu" and fits else "reference"
    assert ops.dispatch.choose_impl("mhc_front", "auto", lambda: fits) == want
    assert not forms.triton_supports(streams, fn[:4])
    assert not forms.triton_supports(streams.astype(jnp.float16), fn)
    wide = jnp.zeros((2, 9, 8), jnp.bfloat16)
    assert not forms.triton_supports(wide, jnp.zeros((99, 72), jnp.float32))


@pytest.mark.parametrize("given", [False, True])
def test_the_kernels_compile_for_hopper(given):
    """Both kernels compile for sm_90 on this CPU at DeepSeek-V4.1-Flash's shapes (hc 4, d 4096,
    bf16 streams, one token): the GPU path's errors, which the interpreter does not see."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tidejax.pallas.mhc_kernel import mhc_finish_kernel, mhc_project_kernel

    hc, d = 4, 4096
    splits, per = forms.split_k(1, hc * d)
    project = dict(K=hc * d, O=24, O_P=32, BT=forms.BT, BK=forms.BK, STEPS=per)
    finish = dict(HC=hc, HC_P=4, D=d, O_P=32, ITERS=20, BLOCK=forms.BLOCK, BD=forms.BD,
                  SB=forms.SB, GIVEN=given)
    for kernel, arrays, scalars, meta in (
            (mhc_project_kernel, dict(x_ptr="*bf16", fn_ptr="*fp32"), dict(n="i32"), project),
            (mhc_finish_kernel,
             dict(part_ptr="*fp32", sq_ptr="*fp32", base_ptr="*fp32", scale_ptr="*fp32",
                  x_ptr="*bf16", given_ptr="*fp32"),
             dict(n="i32", splits="i32", eps="fp32", hc_eps="fp32"), finish)):
        outs = ("part_ptr", "sq_ptr") if kernel is mhc_project_kernel else (
            "pre_ptr", "post_ptr", "comb_ptr", "out_ptr")
        out_types = {name: "*bf16" if name == "out_ptr" else "*fp32" for name in outs}
        signature = {**arrays, **scalars, **out_types, **{name: "constexpr" for name in meta}}
        pointers = [i for i, kind in enumerate(signature.values()) if kind.startswith("*")]
        aligned = {(i,): [["tt.divisibility", 16]] for i in pointers}  # as jax-triton's arrays
        compiled = triton.compile(ASTSource(kernel, signature, meta, aligned),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": forms.NUM_WARPS})
        assert compiled.asm["cubin"]
