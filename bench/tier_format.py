"""The disk tier's file format against orbax-checkpoint, on one page (kv/tiers.py).

A page of the 40-layer V3-family synthetic at 64 tokens: 40 leaves [1, 64, 576] bfloat16 (MLA
latents and rotated keys), 2.95 MB. Times the disk tier's own write (temp file, fsync, rename)
and its checked read against orbax's PyTreeCheckpointer save and restore of the same tree, each
the median of `--repeats` runs into a temporary folder.

    python -m bench.tier_format [--repeats 20] [--folder /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.kv.tiers import DiskTier, Spilled


def page() -> Spilled:
    rng = np.random.default_rng(0)
    leaves = {f"layer_{i}": rng.standard_normal((1, 64, 576), np.float32).astype(jnp.bfloat16)
              for i in range(40)}
    return Spilled(leaves)


def median_ms(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--folder", default=None, help="where the files go (default: tmp)")
    args = parser.parse_args()
    entry = page()
    template = Spilled(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    entry.pages))
    print(f"page: {entry.nbytes / 1e6:.2f} MB in {len(jax.tree.leaves(entry.pages))} leaves")
    with tempfile.TemporaryDirectory(dir=args.folder) as root:
        disk = DiskTier(Path(root) / "raw", 1 << 40, template)
        digests = [i.to_bytes(16, "little") for i in range(args.repeats)]
        save = median_ms(lambda i: disk._write(digests[i], entry), args.repeats)
        load = median_ms(lambda i: disk.read(digests[i]), args.repeats)
        assert all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(disk.read(digests[0]).pages), jax.tree.leaves(entry.pages)))
        disk.close()
        print(f"raw bytes (kv/tiers.py): save {save:.1f} ms, restore {load:.1f} ms")

        import orbax.checkpoint as ocp
        checkpointer = ocp.PyTreeCheckpointer()
        folder = Path(root) / "orbax"
        save = median_ms(lambda i: checkpointer.save(folder / str(i), entry.pages), args.repeats)
        load = median_ms(lambda i: checkpointer.restore(folder / str(i)), args.repeats)
        print(f"orbax PyTreeCheckpointer: save {save:.1f} ms, restore {load:.1f} ms")


if __name__ == "__main__":
    main()
