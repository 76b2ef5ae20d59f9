"""Seed maps: the resident set fitted to a budget from a demand history (its routing-weight
demand: history.py), loaded at boot.

File (JSON): {"format": "tidejax-seed-map/1", "geometry", "n_layers", "n_experts", "budget",
"rows": [pool rows, busiest first within each layer / the arena], "mtp_layers"}; pool row =
layer * E + expert. `mtp_layers` (absent: 0): how many of the n_layers, the last, are MTP
layers' (a history saved speculating: history.py); a map is read only by an engine that serves
as many (speculation on or off as when it was fitted), else refused naming the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tidejax.errors import ConfigError
from tidejax.fields import read_json
from tidejax.residency.history import History
from tidejax.residency.planner import fit_rows

FORMAT = "tidejax-seed-map/1"


def fit(history: History, budget: int, geometry: str = "per_layer") -> dict:
    n_layers, n_experts = history.shape
    if not 0 < budget <= n_layers * n_experts:
        raise ValueError(f"budget {budget} must be in [1, {n_layers * n_experts}]")
    if geometry == "per_layer" and budget < n_layers:
        raise ValueError(f"budget {budget} gives no slot to some of the {n_layers} layers")
    return {"format": FORMAT, "geometry": geometry, "n_layers": n_layers, "n_experts": n_experts,
            "budget": budget, "rows": fit_rows(history.demand, budget, geometry).tolist(),
            "mtp_layers": history.mtp_layers}


def write(seed: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(seed))
    os.replace(tmp, path)


def read(path: str | os.PathLike, n_layers: int, n_experts: int,
         mtp_layers: int = 0) -> np.ndarray:
    """The map's rows, checked against this model's shape (`mtp_layers` of its n_layers the MTP
    layers'); errors name the file and field."""
    path = Path(path)
    seed = read_json(path)  # a missing or malformed file: a ConfigError naming it
    if not isinstance(seed, dict) or seed.get("format") != FORMAT:
        raise ConfigError(f"{path}: field 'format' should be {FORMAT!r}")
    if seed.get("mtp_layers", 0) != mtp_layers:
        raise ConfigError(f"{path}: field 'mtp_layers' = {seed.get('mtp_layers', 0)!r}, this "
                          f"engine serves {mtp_layers} MTP layers' experts ([speculative] method "
                          f"{'is' if mtp_layers else 'is not'} 'mtp'): fit the map again")
    for field, want in (("n_layers", n_layers), ("n_experts", n_experts)):
        if seed.get(field) != want:
            raise ConfigError(f"{path}: field '{field}' = {seed.get(field)!r}, this model has "
                              f"{want}")
    rows = seed.get("rows")
    if (not isinstance(rows, list) or not all(isinstance(r, int) for r in rows)
            or any(not 0 <= r < n_layers * n_experts for r in rows)):
        raise ConfigError(f"{path}: field 'rows' should be a list of pool rows in "
                          f"[0, {n_layers * n_experts})")
    return np.asarray(rows, np.int32)
