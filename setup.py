"""The cpu miss policy's host kernel (tidejax/residency/cpu_kernel.c) and its XLA custom call
(cpu_ffi.cc), one C/C++ extension; the rest of the package is declared in pyproject.toml.
Optional: where it does not compile, tidejax installs anyway and the policy runs its numpy path
through jax.pure_callback (tidejax.residency.cpu.kernel_isa() says which). The custom call needs
XLA's FFI headers, which jaxlib ships (a build requirement in pyproject.toml); without them the
kernel is built alone (TJ_NO_FFI) and the policy calls it through jax.pure_callback."""

import importlib.util
import os

from setuptools import Extension, setup


def xla_ffi_include() -> str | None:
    """jaxlib's include directory (xla/ffi/api/ffi.h), where jaxlib is installed."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return include if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")) else None


include = xla_ffi_include()
sources = ["tidejax/residency/cpu_kernel.c"] + (["tidejax/residency/cpu_ffi.cc"] if include else [])
setup(ext_modules=[Extension(
    "tidejax.residency._cpu_kernel", sources, language="c++",
    define_macros=[] if include else [("TJ_NO_FFI", "1")],
    extra_compile_args=["-O3"] + (["-isystem", include] if include else []),
    extra_link_args=["-pthread", "-ldl"], optional=True)])
