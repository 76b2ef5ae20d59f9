"""Helpers the test modules share (tiny checkpoints, fixtures of the server and residency, the
V4.1 runner); test modules import these, never each other."""
