"""Tools that make the bundled demo model and synthetic checkpoints; run from the repository root
as `python -m tools.NAME`."""
