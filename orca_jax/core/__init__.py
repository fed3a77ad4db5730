"""The scheduling core: Orca's loop (policy -> plan -> checks -> pack -> engine -> update).

Its folders sit in layers that only look down (`docs/architecture.md`):

    requests/  Request, the RequestTable, the run's records and RunResult (the bottom)
    step/      the engine contract, buckets, and the step-descriptor builder (`pack_step`)
    kv/        KV memory: the pool and its layouts, the prefix cache, the capacity
               question, tiers and preemption modes
    plans/     StepPlan, its checks, and the read-only SchedulerView
    api/       the policy API: Policy and its registry, plugin loading, shared helpers
    loop/      the Scheduler's two phases (schedule / update), the Executor and its
               steps in flight, the watchdog, a request's export and import

`json_files` (JSON values and atomic writes) serves every part of the library.

May import: numpy and the standard library only — never jax, and nothing else
of `orca_jax` (every other part builds on this one). `tests/test_architecture.py`
holds the folders' layers too.
"""
