"""A run assembled from its spec: workload, engine, scheduler, policy -> results.

    spec         `RunSpec` and its parts (what the command-line flags resolve to)
    engine_spec  the engine part of the spec (the jax engine's or the simulator's settings)
    cluster_spec the cluster part of the spec (replicas, routers, pools, migration, planner)
    spec_fields  a spec field's documentation as data, and the checks the parts share
    spec_caps    range caps on a spec's counts: what this machine's memory can hold
    build        the run's workload, scheduler limits and engine from its spec
    experiment   running one policy (or a cluster) and writing its results
    live_results streaming a live run's steps and finished requests into its folder
    sweep        the sweep runner that the sweep command and the reproductions share
    sweep_point  one point of a sweep (its workload, run and outcome), here or in a Ray task
    ray_sweep    a sweep's points as Ray tasks (`--executor=ray`; Ray is an extra)

May import: every other part of `orca_jax` (it is the top layer); never
`experiments`.
"""
