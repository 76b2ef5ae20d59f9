"""DeepSeek-V4.1's tiny_a golden in the published formats: dense weights FP8 e4m3 with e8m0
128x128 block scales, routed experts FP4 (e2m1 pairs + e8m0 scales per 32), Engram tables FP8 with
e8m0 scales per 32 channels, no `model.` prefix and `head.weight` (conftest.py's `published`
writes it once a session)."""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from tidejax.checkpoint import mxfp4

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v41" / "tiny_a"  # widths divisible by 32
E4M3, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
_FLOAT_ONLY = ("hc_", "norm", "attn_sink", "gate.", "embed.weight", "lm_head", "q_weight", "k_weight")


def _e8m0_scale(amax):
    """Power-of-two scale >= amax / 448, as e8m0."""
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0))
    return np.ldexp(np.float32(1), exponent.astype(np.int32)).astype(E8M0)


def fp8_blocks(w, block):
    """w [r, c] -> (e4m3 [r, c], e8m0 scales [ceil(r/b0), ceil(c/b1)])."""
    b0, b1 = block
    r, c = w.shape
    nr, nc = -(-r // b0), -(-c // b1)
    padded = np.zeros((nr * b0, nc * b1), np.float32)
    padded[:r, :c] = w
    scale = _e8m0_scale(np.abs(padded.reshape(nr, b0, nc, b1)).max(axis=(1, 3)))
    full = np.repeat(np.repeat(scale.astype(np.float32), b0, 0), b1, 1)[:r, :c]
    return (w / full).astype(E4M3), scale


def dequant_fp8(q, scale, block):
    full = np.repeat(np.repeat(scale.astype(np.float32), block[0], 0), block[1], 1)
    return q.astype(np.float32) * full[:q.shape[0], :q.shape[1]]


def write_published(out: Path) -> dict[str, np.ndarray]:
    """Writes the quantized checkpoint into `out`; returns the float tensors it stands for."""
    src = load_file(GOLDEN / "model.safetensors")
    quant, exact = {}, {}
    for name, w in src.items():
        key = name.removeprefix("model.")
        key = "head.weight" if key == "lm_head.weight" else key
        if ".experts." in key:
            blocks, scales = mxfp4.quantize(w)
            quant[key] = blocks.reshape(w.shape[0], -1)
            quant[key.removesuffix(".weight") + ".scale"] = scales.view(E8M0)
            exact[name] = mxfp4.dequantize(blocks, scales)
        elif key.endswith("engram.embed.weight"):
            q, s = fp8_blocks(w, (1, 32))
            quant[key], quant[key.removesuffix(".weight") + ".scale"] = q, s
            exact[name] = dequant_fp8(q, s, (1, 32))
        elif key.endswith("engram.embed.scale"):
            continue
        elif w.ndim == 2 and not any(f in key for f in _FLOAT_ONLY):
            q, s = fp8_blocks(w, (128, 128))
            quant[key], quant[key.removesuffix(".weight") + ".scale"] = q, s
            exact[name] = dequant_fp8(q, s, (128, 128))
        else:
            quant[key] = exact[name] = w
    out.mkdir(parents=True, exist_ok=True)
    save_file(quant, out / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GOLDEN / f, out / f)
    return exact


def write_published_pair(root: Path) -> Path:
    """root/fp8: tiny_a in the published formats; root/float: a float checkpoint of exactly the
    values they stand for. Returns root."""
    exact = write_published(root / "fp8")
    (root / "float").mkdir()
    save_file(exact, root / "float" / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GOLDEN / f, root / "float" / f)
    return root
