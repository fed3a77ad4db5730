"""A run assembled from its spec: workload, engine, scheduler, policy -> results.

Owns `RunSpec` (what the command-line flags resolve to), building the run's
workload, engine and limits, running one policy (or a cluster), and the sweep
runner that the sweep command and the reproductions share.

May import: every other part of `orca_jax` (it is the top layer); never
`experiments`.
"""
