"""Adaptive expert residency: host pool, device bank, rowmap, demand history, planner, seed maps,
miss policies and telemetry (DESIGN.md "Residency")."""

from tidejax.residency.manager import Residency
from tidejax.residency.serve import ServeOptions, serve_routed
from tidejax.residency.state import ExpertState, all_resident_state, build_state

__all__ = ["ExpertState", "Residency", "ServeOptions", "all_resident_state", "build_state",
           "serve_routed"]
