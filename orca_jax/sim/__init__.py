"""The simulated engine: the same step descriptors, priced by a cost model instead of run.

Owns the cost model (per-operation roofline, whole-step roofline, fixed,
fitted), the reader of the measured GPU kernel times the per-operation one is
checked against (`kernel_profiles`), `SimEngine`, the grid of step
compositions that profiles a real engine, and the fit of the cost model to
those measurements (save, load, `cost_config_from_fit`).

May import: numpy, `orca_jax.core`, `orca_jax.specs`, and jax-free modules of
`pallas_kernels` (the reference op's tile sizes) — never jax.
"""
