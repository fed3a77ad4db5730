"""The policy API: `Policy` and its registry (`register`, `make_policy`), plugin
loading by name, `module:Class` or `file.py:Class` (`plugins`), and the helpers
policies share (`plan_in_order`, `fit_to_budget`). The package face `orca_jax`
re-exports it.

May import: `orca_jax.core.requests`, `orca_jax.core.step`, `orca_jax.core.kv` and
`orca_jax.core.plans`.
"""
