"""The settings a policy actually ran under: its effective token budget, batch cap, KV
reservation, prefix caching and whether host time was counted.

A policy's knobs and the scheduler's limits both cap a step; what a step may hold
is the smaller of the two. The built-in policies name their own caps after the
scheduler's limits (`max_num_tokens`: tokens per step, Sarathi-Serve's chunk
size, vLLM's `max_num_batched_tokens`; `max_num_seqs`: the batch cap; None: the
scheduler's), so a policy with such a knob runs at `min(knob, limit)`, and one
without it (orca, static, the ranking policies) at the scheduler's limit.
Prefix caching is active as the run's switch (`--prefix_caching`,
`KVConfig.prefix_caching`) decides it for the policy: `on` every policy, `off`
none, `policy` (the default) the policy's own opt-in (`Policy.prefix_caching`),
as the scheduler decides it (`prefix_caching_active`).

compare prints these per policy and warns when the ones that change results
(`RESULT_SETTINGS`) differ between the policies it compares.
"""

from __future__ import annotations

from typing import Any, Optional

from orca_jax.core.api.policy import Policy, prefix_caching_active
from orca_jax.core.loop.config import SchedulerConfig

# The per-policy settings compare shows, in its table's order.
SETTINGS = ("token_budget", "batch_cap", "kv_reservation", "prefix_caching", "count_host_time")
# Those that change a run's results when they differ between compared policies and are
# not the policy's own algorithm (KV reservation is: Orca's `max` against vLLM's paging).
RESULT_SETTINGS = ("token_budget", "batch_cap", "prefix_caching")


def _capped(policy: Policy, knob: str, limit: int) -> int:
    """`min(knob, limit)` for a policy knob named like the limit (None or absent: the limit)."""
    value: Optional[Any] = getattr(policy, knob, None)
    if type(value) is not int:
        return limit
    return min(value, limit)


def effective_settings(policy: Policy, config: SchedulerConfig) -> dict[str, Any]:
    """The settings `policy` runs under with `config` (see the module docstring).

    Returns:
      `token_budget` (tokens per step), `batch_cap` (sequences per step),
      `kv_reservation`, `prefix_caching` (active, bool) and `count_host_time` (bool).
    """
    limits = config.limits
    return {
        "token_budget": _capped(policy, "max_num_tokens", limits.max_num_tokens),
        "batch_cap": _capped(policy, "max_num_seqs", limits.max_num_seqs),
        "kv_reservation": policy.kv_reservation,
        "prefix_caching": prefix_caching_active(policy, config.kv.prefix_caching, ValueError),
        "count_host_time": bool(config.features.count_host_time),
    }
