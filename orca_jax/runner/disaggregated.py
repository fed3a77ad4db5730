"""A disaggregated run from its spec: a prefill pool, a decode pool, the KV link.

`run_disaggregated` is `run_policy`'s path for a `ClusterSpec` with prefill and
decode pools (`orca_jax.cluster.disaggregated`): each pool runs its own policy
(the run's by default) on engines built from the run's engine spec, and the
KV transfers are priced from the model's shapes, the engine's dtype and TP
degree, and the `kv_link` preset. Its results add `transfers.jsonl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from orca_jax.core.api.plugins import parse_options
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import SchedulerConfig
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.summary import summarize_run
from orca_jax.runner.build import build_engine, transfer_cost  # noqa: F401  (its home was here)
from orca_jax.runner.spec import RunSpec

if TYPE_CHECKING:  # imported by a disaggregated run only (`run_disaggregated`)
    from orca_jax.cluster.disaggregated import DisaggregatedCluster
    from orca_jax.results.qoe import TokenTimes  # a --log_token_times run's (below)


def num_gpus(spec: RunSpec) -> int:
    """GPUs the run occupies: every replica's TP degree times its pipeline stages, summed."""
    cluster = spec.cluster
    replicas = (cluster.num_prefill_replicas + cluster.num_decode_replicas
                if cluster.disaggregated else cluster.replica_caps[1] if cluster.planner
                else cluster.num_replicas)
    return replicas * spec.engine.tp * spec.engine.pp


def token_times(spec: RunSpec, result: RunResult) -> Optional[TokenTimes]:
    """The run's token times by request and each finished request's QoE, with
    `spec.log_token_times` (None without: the run writes and summarizes none).

    Raises:
      ValueError: the result kept no token log (its scheduler counted its tokens).
    """
    if not spec.log_token_times:
        return None
    from orca_jax.results.qoe import QoETargets, TokenTimes  # lazy: such runs' only
    if result.token_req is None or result.token_time_s is None:
        raise ValueError("log_token_times: the run kept no token log (build its scheduler "
                         "with log_tokens=True)")
    return TokenTimes.from_log(result.token_req, result.token_time_s, result.arrival_s,
                               result.state == RequestState.FINISHED,
                               QoETargets(spec.qoe_ttft_s, spec.qoe_tokens_per_s))


def _pool_policy(policy_spec: str, policy_options: Optional[Mapping[str, str]],
                 pool_policy: Optional[str], pool_options: Optional[str]
                 ) -> tuple[str, Optional[Mapping[str, str]]]:
    """A pool's policy and knobs: its own, or the run's."""
    name = pool_policy or policy_spec
    if pool_options is not None:
        return name, parse_options(pool_options)
    return name, (policy_options if name == policy_spec else None)


def run_disaggregated(spec: RunSpec, policy_spec: str,
                      policy_options: Optional[Mapping[str, str]], config: SchedulerConfig,
                      workload: list[Request]
                      ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], RunResult,
                                 DisaggregatedCluster, dict[str, Any], Optional[TokenTimes]]:
    """Runs `workload` on the spec's prefill and decode pools.

    Returns:
      The summary (with each pool's policy), the tables beside it (`summarize_run`:
      transfers, replicas), the joined result, the cluster (its replicas, for
      config.json), config.json's `pools` section, and the token times by request
      (`token_times`: None unless `spec.log_token_times`).
    """
    from orca_jax.cluster.disaggregated import DisaggregatedCluster, PoolSpec

    cluster_spec = spec.cluster
    pools = {}
    for role, count, policy, options, router, router_opts in (
            ("prefill", cluster_spec.num_prefill_replicas, cluster_spec.prefill_policy,
             cluster_spec.prefill_policy_opts, cluster_spec.prefill_router,
             cluster_spec.prefill_router_opts),
            ("decode", cluster_spec.num_decode_replicas, cluster_spec.decode_policy,
             cluster_spec.decode_policy_opts, cluster_spec.decode_router,
             cluster_spec.decode_router_opts)):
        name, knobs = _pool_policy(policy_spec, policy_options, policy, options)
        make_policy(name, knobs)  # a bad pool policy fails here, before any engine is built
        pools[role] = PoolSpec(num_replicas=count,
                               make_policy=lambda name=name, knobs=knobs: make_policy(name, knobs),
                               make_engine=lambda: build_engine(spec, config), config=config,
                               router=router, router_options=parse_options(router_opts))
    cost = transfer_cost(spec)
    cluster = DisaggregatedCluster(workload, prefill=pools["prefill"], decode=pools["decode"],
                                   transfer_cost=cost)
    result = cluster.run()
    times = token_times(spec, result)
    summary, tables = summarize_run(result, ttft_slo_s=spec.ttft_slo_s,
                                    tpot_slo_s=spec.tpot_slo_s, num_gpus=num_gpus(spec),
                                    token_times=times)
    prefill_policy, decode_policy = cluster.prefill[0].policy, cluster.decode[0].policy
    summary["prefill_policy"], summary["decode_policy"] = prefill_policy.name, decode_policy.name
    pool_config = {"prefill_policy": prefill_policy.name, "decode_policy": decode_policy.name,
                   "kv_link": {"name": cost.link.name, "latency_s": cost.link.latency_s,
                               "bytes_per_s": cost.link.bytes_per_s,
                               "max_concurrent": cost.link.max_concurrent,
                               "source": cost.link.source},
                   "kv_bytes_per_token_per_shard": cost.bytes_per_token}
    return summary, tables, result, cluster, pool_config, times
