"""Benchmark scripts (run as files: `python bench/NAME.py`); a package so they can share code."""
