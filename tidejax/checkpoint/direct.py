"""Reads that bypass the page cache: O_DIRECT into page-aligned buffers (the residency disk
tier's rows, residency/disk.py), so what is read is read from the disk, and host memory holds only
what its budget keeps. Where the filesystem refuses O_DIRECT (EINVAL: tmpfs before Linux 6.6,
some network filesystems) the file is read buffered instead, said once in the log.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np

from tidejax.errors import CheckpointError

log = logging.getLogger("tidejax.residency")

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page; >= logical blocks)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of `nbytes` (rounded up to ALIGN) starting at an ALIGN-aligned address."""
    raw = np.empty(aligned(nbytes) + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + aligned(nbytes)]


class DirectFile:
    """One file read with O_DIRECT into page-aligned buffers, or buffered where the filesystem
    refuses O_DIRECT (at open or at the first read: EINVAL), which is logged once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.direct = hasattr(os, "O_DIRECT")
        self._fd = None
        self._fd = self._open()

    def _open(self) -> int:
        if self.direct:
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered(e)
        return os.open(self.path, os.O_RDONLY)

    def _buffered(self, why: OSError) -> None:
        self.direct = False
        log.warning("residency: %s refuses O_DIRECT (%s); its rows are read buffered, through "
                    "the page cache", self.path, why.strerror)

    def __del__(self, close=os.close):  # bound here: at interpreter exit `os` may be gone
        if getattr(self, "_fd", None) is not None:
            close(self._fd)

    def read(self, begin: int, nbytes: int) -> np.ndarray:
        """Bytes [begin, begin + nbytes) (begin a multiple of ALIGN) as a uint8 array at an
        aligned address; CheckpointError naming the file where it ends before them."""
        out, done = aligned_buffer(nbytes), 0
        while done < nbytes:
            try:
                n = os.preadv(self._fd, [memoryview(out[done:])], begin + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._buffered(e)
                os.close(self._fd)
                self._fd = None
                self._fd = self._open()
                continue
            done += n
            if n == 0 or (self.direct and done % ALIGN):  # the end of the file
                break
        if done < nbytes:
            raise CheckpointError(f"{self.path}: truncated: bytes up to {begin + nbytes} are "
                                  f"read, the file ends at {begin + done}")
        return out[:nbytes]

    def read_span(self, begin: int, nbytes: int) -> np.ndarray:
        """Bytes [begin, begin + nbytes) at any offset: the aligned span around them read, the
        bytes a view into it."""
        start = begin - begin % ALIGN
        return self.read(start, begin - start + nbytes)[begin - start:]
