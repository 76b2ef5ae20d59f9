"""Files under residency.state_dir: written atomically (a kill at any moment leaves the last good
copy), a corrupt one set aside with a warning at start. The demand history is one
(history.py); the residency stats, the counters that resume after a restart, are the other
(`save_stats` / `resume_stats`, state_dir/stats.json)."""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("tidejax.residency")

STATS_FORMAT = "tidejax-residency-stats/1"


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """A temporary file in the same directory, fsync, os.replace, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def clear_torn(path: str | os.PathLike) -> None:
    """Removes the temporary files a writer of `path` left when it was killed."""
    path = Path(path)
    if path.parent.is_dir():
        for torn in path.parent.glob(f".{path.name}.*.tmp"):
            torn.unlink(missing_ok=True)


def set_aside(path: Path, problem: str, what: str) -> None:
    """Renames an unusable file `path` to `*.corrupt-<time>` with one warning line."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.replace(path, aside)
    log.warning("%s; set aside as %s, starting %s", problem, aside, what)


def save_stats(path: str | os.PathLike, counters: collections.Counter) -> None:
    write_atomic(path, json.dumps({"format": STATS_FORMAT, "counters": dict(counters)},
                                  sort_keys=True).encode())


def read_stats(path: str | os.PathLike) -> collections.Counter:
    """The counters saved at `path`; a ValueError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        saved = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a residency stats file ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict) or saved.get("format") != STATS_FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{path}: format {got!r}, expected {STATS_FORMAT!r}")
    counters = saved.get("counters")
    if not isinstance(counters, dict):
        raise ValueError(f"{path}: 'counters' should be an object of counts")
    for name, value in counters.items():
        if type(value) is not int or value < 0:
            raise ValueError(f"{path}: 'counters.{name}' = {value!r} is not a count")
    return collections.Counter(counters)


def resume_stats(path: str | os.PathLike, expected: bool) -> collections.Counter:
    """The saved counters at `path` to count on from; a fresh start (zeros) with one warning line
    where the file is corrupt or malformed (it is set aside, named), or missing though
    `expected` (a history was saved beside it)."""
    path = Path(path)
    clear_torn(path)
    if not path.is_file():
        if expected:
            log.warning("%s is missing; residency stats start from zero", path)
        return collections.Counter()
    try:
        return read_stats(path)
    except ValueError as e:
        set_aside(path, str(e), "the residency stats from zero")
        return collections.Counter()
