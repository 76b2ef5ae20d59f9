"""Where models reach the FP8 block-scaled matmul (models never import tidejax.pallas)."""

from tidejax.pallas.fp8_matmul import fp8_block_matmul

__all__ = ["fp8_block_matmul"]
