"""The scheduling core: Orca's loop (policy -> plan -> checks -> pack -> engine -> update).

Owns requests and the request table, the step plan and its checks, the
read-only view a policy decides through, the scheduler and the executor that
runs its steps and keeps the virtual clock, KV memory (`orca_jax.core.kv`: the
pool and its layouts, the prefix cache, the capacity question, tiers and
preemption), buckets and the step-descriptor builder (`packing`), the engine
contract, the policy API and plugin loading, a request moved between
schedulers (`request_export`), and a finished run's value (`RunResult`).

May import: numpy and the standard library only — never jax, and nothing else
of `orca_jax` (every other part builds on this one). `orca_jax.core.kv` sits
below the rest of the core: it imports only the request and the request table.
"""
