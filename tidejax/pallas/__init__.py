"""GPU kernels (Pallas, Triton lowering) and their jnp references, which run everywhere; one
module an op (attention.py, index_scores.py, moe.py with moe_kernel.py, fp8_matmul.py), beside
the bank helpers (bank.py) and the demand counters (demand.py). Nothing outside tidejax.ops
calls a kernel or a reference: the ops pick between them (tidejax/ops/), and what the kernels
agree on with their callers is tidejax.contract."""
