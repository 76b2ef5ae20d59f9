"""A crashed pytest-xdist worker's Python stacks at the end of the run's output.

A worker that dies of a fatal signal prints faulthandler's dump of every thread to its stderr,
which the controller interleaves with the progress dots; CI keeps only the output's tail, where
the main thread's execnet frames sit, and the thread that crashed (dumped first) is cut off.
So each worker also sends that dump to a file of its own (`enable_in_worker`), and the
controller prints each non-empty one, shortened to the frames that tell where it was, in the
run's summary (`summarize`)."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from pathlib import Path

FOLDER_VARIABLE = "TIDEJAX_FAULT_DIR"  # set by the controller, inherited by its workers
MAX_LINES = 60
_files = []  # the open dump files: faulthandler writes to their descriptors at a crash


def prepare() -> None:
    """In the controller, before the workers start: the folder their dumps go to."""
    if FOLDER_VARIABLE not in os.environ:
        os.environ[FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="tidejax-faults-")


def enable_in_worker(worker: str) -> None:
    """In worker `worker` (gw0, ...): fatal errors dump every thread's stack to its file."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if folder:
        _files.append(open(Path(folder) / f"{worker}.log", "w"))
        faulthandler.enable(file=_files[-1], all_threads=True)


def summarize(write_line) -> None:
    """In the controller at the end: each worker's dump, if it wrote one, through write_line."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder:
        return
    for path in sorted(Path(folder).glob("*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            write_line(f"fatal error in worker {path.stem}:")
            for line in shortened(text.splitlines()):
                write_line(line)


def shortened(lines: list[str]) -> list[str]:
    """The dump with each thread's frames cut to those of this project (and the first three,
    which say what the thread was doing), the crashed ("Current") thread's kept whole."""
    out, block = [], []

    def flush():
        if not block:
            return
        header, frames = block[0], block[1:]
        if not header.startswith("Current thread"):
            own = [f for f in frames if "/tidejax/" in f or "/tests/" in f]
            frames = frames[:3] + [f for f in own if f not in frames[:3]][:6]
        out.extend([header] + frames)
        block.clear()

    for line in lines:
        if line.startswith(("Current thread", "Thread 0x")):
            flush()
            block.append(line)
        elif block and line.startswith("  File"):
            block.append(line)
        else:
            flush()
            if line.strip() and not line.startswith("Extension modules"):
                out.append(line)
    flush()
    return out[:MAX_LINES]
