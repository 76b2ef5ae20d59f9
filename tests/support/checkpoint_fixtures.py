"""Test helpers that write checkpoints with the reference safetensors writer (through torch,
which, unlike safetensors.numpy, stores float8 dtypes): single file or sharded with an index,
the per-expert expert layout, DeepSeek FP8 block-scaled weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file

from tidejax.checkpoint import quantize_fp8_block

# numpy dtypes torch.from_numpy cannot take: (numpy bits, torch bits, torch dtype)
_VIA_BITS = {
    np.dtype(ml_dtypes.bfloat16): (np.int16, torch.int16, torch.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.uint8, torch.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.uint8, torch.float8_e5m2),
    np.dtype(ml_dtypes.float8_e8m0fnu): (np.uint8, torch.uint8, torch.float8_e8m0fnu),
}


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.array(a, order="C")  # a copy; keeps 0-d arrays 0-d
    if a.dtype in _VIA_BITS:
        np_bits, _, dtype = _VIA_BITS[a.dtype]
        return torch.from_numpy(a.view(np_bits)).view(dtype)
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor (a transformers state dict value) as numpy, bf16 kept as ml_dtypes."""
    t = t.detach().cpu().contiguous()
    for np_dtype, (_, torch_bits, dtype) in _VIA_BITS.items():
        if t.dtype == dtype:
            return t.view(torch_bits).numpy().view(np_dtype)
    return t.numpy()


def save_checkpoint(model_dir: str | Path, tensors: dict[str, np.ndarray],
                    n_shards: int = 1) -> Path:
    """Write model.safetensors (n_shards=1) or n shards + model.safetensors.index.json, the
    tensors dealt to shards in name order as transformers does (contiguous runs)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if n_shards == 1:
        save_file({n: to_torch(tensors[n]) for n in names}, model_dir / "model.safetensors")
        return model_dir
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.array(names, dtype=object), n_shards)):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: to_torch(tensors[n]) for n in chunk}, model_dir / shard)
        weight_map.update({n: shard for n in chunk})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
             "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return model_dir


def to_per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers-5 fused experts ({p}.experts.gate_up_proj [E, 2I, D], down_proj [E, D, I])
    -> published per-expert tensors {p}.experts.{e}.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            p = f"{m[1]}.{e}"
            if m[2] == "down_proj":
                out[f"{p}.down_proj.weight"] = t[e]
            else:
                gate, up = np.split(t[e], 2)
                out[f"{p}.gate_proj.weight"], out[f"{p}.up_proj.weight"] = gate, up
    return out


def is_deepseek_fp8(name: str, t: np.ndarray) -> bool:
    """DeepSeek-V3 FP8 checkpoints quantize the 2-D linear weights of attention and MLPs
    (including experts); embeddings, lm_head, norms and the router gate stay bf16."""
    return t.ndim == 2 and name.endswith("_proj.weight")


def to_fp8(tensors: dict[str, np.ndarray], select=is_deepseek_fp8) -> dict[str, np.ndarray]:
    """Quantize the selected weights to e4m3 + `weight_scale_inv` (128 x 128 blocks)."""
    out = {}
    for name, t in tensors.items():
        if select(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t.astype(np.float32))
        else:
            out[name] = t
    return out
