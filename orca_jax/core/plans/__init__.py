"""What a policy says and what it sees: the `StepPlan`, its checks (`plan_checks`:
each broken rule one `PlanError` naming the policy and the rule), the read-only
`SchedulerView`, and `SchedulerState`, the part of a scheduler the checks and the
view read.

May import: `orca_jax.core.requests`, `orca_jax.core.step` and `orca_jax.core.kv`
(the capacity question the checks and the view ask).
"""
