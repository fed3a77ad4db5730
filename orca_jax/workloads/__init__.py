"""Workloads: the requests of a run, synthetic (seeded) or read from trace files.

Owns length distributions and arrival processes (`synthetic`), workloads whose
prompts share prefixes (`prefix_workloads`: shared system prompts, multi-turn
conversations), the JSONL/CSV trace reader and writer (`traces`, one record's
fields in `trace_records`) and prompts given as hashed blocks (`hashed_blocks`).

May import: numpy, `orca_jax.core`.
"""
