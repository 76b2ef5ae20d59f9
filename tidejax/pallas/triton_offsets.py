"""Work-around: 64-bit pointer offsets in Pallas' Triton lowering for refs of 2**31+ elements.

jax's lowering (0.10-0.11) picks 32-bit offsets while the ref's byte size is <= 2**32, but Triton
adds offsets to pointers as *signed*: a uint8 ref of 2-4 GiB (a DeepSeek-V4.1-Flash MXFP4 bank's
`down_blocks` at 384 slots is 2.26 GB) then reads below its start for elements past 2**31
(seen on the H200: wrong outputs for slots >= 364). We make such refs look 8 bytes an element
to the offset-width test only, which selects 64-bit offsets; strides and loads are unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax._src import core as jax_core
from jax._src.pallas.triton import lowering as _lowering


def _offsets_wide_past_2_31(block_info, nd_indexer):
    full = block_info.full_shape_dtype
    if math.prod(full.shape) >= 2**31:
        wide = jax_core.ShapedArray(full.shape, np.dtype(np.int64))
        block_info = dataclasses.replace(block_info, full_shape_dtype=wide)
    return _original(block_info, nd_indexer)


_original = getattr(_lowering, "_compute_offsets_from_indices", None)
if _original is not None and getattr(_original, "__name__", "") != _offsets_wide_past_2_31.__name__:
    _lowering._compute_offsets_from_indices = _offsets_wide_past_2_31
