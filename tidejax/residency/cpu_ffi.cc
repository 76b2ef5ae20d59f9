/* The `cpu` miss policy's host kernel as an XLA custom call (jax.ffi) on the CPU platform: one
   MoE layer's missed picks computed from a pool registered with set_pool (cpu_kernel.c), on
   XLA's thread, with no Python in the step (jax.pure_callback costs ~0.3 ms a call there:
   bench/cpu_experts.py --calls-only).

   tidejax_cpu_misses(x f32 [T, D], ids s32 [T, k], weights f32 [T, k], miss pred [T, k];
                      pool: s64, moe_index: s64, swiglu_limit: f32) -> y f32 [T, D]

   On a GPU the step still calls the kernel through jax.pure_callback: a CUDA handler (the
   inputs copied to pinned memory and the kernel run by cuLaunchHostFunc on the step's stream)
   is written on the branch cuda-ffi but has never run on a GPU (DESIGN.md "Not yet"). */

#include <cstdint>
#include <string>

#include "cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kErrLen = 256;

ffi::Error MissesOnCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::PRED> miss,
                       ffi::ResultBuffer<ffi::F32> y, int64_t pool, int64_t moe_index,
                       float swiglu_limit) {
  auto xd = x.dimensions(), kd = ids.dimensions();
  if (xd.size() != 2 || kd.size() != 2 || kd[0] != xd[0] ||
      weights.element_count() != ids.element_count() ||
      miss.element_count() != ids.element_count())
    return ffi::Error::InvalidArgument("tidejax_cpu_misses: x [T, D], ids / weights / miss [T, k]");
  tj_pool *p = tj_pool_get(pool);
  if (!p) return ffi::Error::InvalidArgument("tidejax_cpu_misses: no pool " + std::to_string(pool));
  char err[kErrLen];
  if (tj_pool_moe(p, x.typed_data(), xd[0], xd[1], ids.typed_data(), weights.typed_data(),
                  reinterpret_cast<const uint8_t *>(miss.typed_data()), kd[1], moe_index,
                  swiglu_limit, y->typed_data(), err, kErrLen))
    return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjCpuMissesCpu, MissesOnCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("pool")
                                  .Attr<int64_t>("moe_index")
                                  .Attr<float>("swiglu_limit"));

extern "C" {
void *const TJ_FFI_CPU_HANDLER = reinterpret_cast<void *>(TjCpuMissesCpu);
}
