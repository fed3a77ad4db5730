"""Workloads: the requests of a run, synthetic (seeded) or read from trace files.

Owns length distributions and arrival processes (`synthetic`) and the
JSONL/CSV trace reader and writer (`traces`).

May import: numpy, `orca_jax.core`.
"""
