"""The cpu miss policy's host kernel (tidejax/residency/cpu_kernel.c), a C extension; the rest of
the package is declared in pyproject.toml. Optional: where it does not compile, tidejax installs
anyway and the policy runs its numpy path (tidejax.residency.cpu.kernel_isa() says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "tidejax.residency._cpu_kernel", ["tidejax/residency/cpu_kernel.c"],
    extra_compile_args=["-O3", "-std=gnu11"], extra_link_args=["-pthread"], optional=True)])
