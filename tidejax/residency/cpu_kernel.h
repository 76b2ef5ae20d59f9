/* The host kernel's interface to its XLA FFI handlers (cpu_ffi.cc): pools of experts registered
   from Python (cpu_kernel.c's set_pool) and one MoE layer's missed picks computed from one. */
#ifndef TIDEJAX_CPU_KERNEL_H
#define TIDEJAX_CPU_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tj_pool tj_pool;

/* The pool set_pool returned `handle` for, or NULL. */
tj_pool *tj_pool_get(int64_t handle);

/* y [t, d] = the weighted sum over the picks (token i / k, expert ids[i]) with miss[i] != 0 of
   the experts of MoE layer `moe_index` (row moe_index * n_experts + id); x [t, d] (d the pool's
   hidden size); ids, weights, miss [t, k]. 0, or -1 with a message in err. */
int tj_pool_moe(tj_pool *pool, const float *x, int64_t t, int64_t d, const int32_t *ids,
                const float *weights, const uint8_t *miss, int64_t k, int64_t moe_index,
                float limit, float *y, char *err, size_t err_len);

/* The CPU platform's handler (an XLA_FFI_Handler), NULL where not built. */
extern void *const TJ_FFI_CPU_HANDLER;

#ifdef __cplusplus
}
#endif

#endif
