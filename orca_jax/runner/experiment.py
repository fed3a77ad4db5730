"""One experiment run: a spec and a policy -> results.

`run_policy` builds the workload, the engine and the scheduler of a `RunSpec`
(`orca_jax.runner.build`), runs one policy, writes the results and returns the
summary. Comparing policies is calling it once per policy with the same spec:
the same seed gives the same workload, and the same bucket set gives the same
steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import Router
from orca_jax.core.engine_api import Engine
from orca_jax.core.json_files import to_json_value
from orca_jax.core.policy import Policy, make_policy, parse_options
from orca_jax.core.request import Request
from orca_jax.core.run_result import RunResult
from orca_jax.core.scheduler import Scheduler, SchedulerConfig
from orca_jax.results.summary import summarize, write_results
from orca_jax.runner.build import (
    build_engine,
    build_workload,
    profile_table_record,
    scheduler_config,
)
from orca_jax.runner.progress import Progress
from orca_jax.runner.spec import RunSpec


class _RunProgress:
    """A scheduler's `progress` callback: requests done of the workload (`Progress`)."""

    def __init__(self, label: str, total: int) -> None:
        self.progress = Progress(f"run {label}", total, "requests")

    def __call__(self, scheduler: Scheduler) -> None:
        self.progress.update(scheduler.num_done, f"{scheduler.num_steps} steps")
        if scheduler.done:
            self.progress.close(f"{scheduler.num_steps} steps")


def run_policy(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]] = None,
               *, out_dir: Optional[str] = None, requests: Optional[list[Request]] = None,
               engine: Optional[Engine] = None, progress: bool = True,
               label: Optional[str] = None) -> tuple[dict[str, Any], RunResult]:
    """Runs one policy on the spec's workload; writes results if `out_dir` is given.

    Args:
      spec: the run's plumbing.
      policy_spec: registered name, `package.module:Class` or `file.py:Class`.
      policy_options: the policy's knobs as text (`--policy_opts`).
      out_dir: where to write config.json, requests.jsonl, steps.jsonl, summary.json.
      requests: the workload, if already built (compare builds it once).
      engine: the engine, if already built (compare shares one between policies,
        so every policy runs the very same compiled steps).
      progress: show progress on runs longer than a few seconds (`runner.progress`).
      label: the run's name in its results (summary.json's `policy`; config.json's
        `policy.label`): compare's and sweep's label; default the policy's name.

    Returns:
      The summary dict and the finished run (of every replica, with several).
    """
    config = scheduler_config(spec)
    workload = requests if requests is not None else build_workload(spec)
    if spec.cluster.num_replicas > 1:
        return _run_cluster(spec, policy_spec, policy_options, config, workload, out_dir,
                            label, progress)
    policy = make_policy(policy_spec, policy_options)
    engine = engine if engine is not None else build_engine(spec, config)
    scheduler = Scheduler(workload, policy, engine, config)
    label = label or policy.name
    result = scheduler.run(progress=_RunProgress(label, len(workload)) if progress else None)
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s)
    summary.update(engine.facts())
    summary["policy"] = label
    if out_dir is not None:
        resolved = _resolved_config(spec, policy_spec, policy, config, engine, label)
        # The profiled clock's table, so a rerun in another process can price steps alike.
        resolved["profile_table"] = profile_table_record(engine, out_dir)
        write_results(out_dir, result, summary, resolved)
    return summary, result


def _run_cluster(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]],
                 config: SchedulerConfig, workload: list[Request],
                 out_dir: Optional[str], label: Optional[str],
                 progress: bool) -> tuple[dict[str, Any], RunResult]:
    """`spec.cluster.num_replicas` simulated replicas behind `spec.cluster.router`."""
    cluster = Cluster(workload, num_replicas=spec.cluster.num_replicas,
                      router=spec.cluster.router,
                      router_options=parse_options(spec.cluster.router_opts),
                      make_policy=lambda: make_policy(policy_spec, policy_options),
                      make_engine=lambda: build_engine(spec, config), config=config)
    first = cluster.replicas[0]
    label = label or first.policy.name
    bar = Progress(f"run {label} on {spec.cluster.num_replicas} replicas", len(workload),
                   "requests") if progress else None
    result = cluster.run(progress=bar.update if bar else None)
    if bar:
        bar.close()
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s)
    summary["policy"] = label
    if out_dir is not None:
        write_results(out_dir, result, summary, _resolved_config(
            spec, policy_spec, first.policy, config, first.engine, label, cluster.router))
    return summary, result


def _resolved_config(spec: RunSpec, policy_spec: str, policy: Policy, config: SchedulerConfig,
                     engine: Engine, label: str,
                     router: Optional[Router] = None) -> dict[str, Any]:
    """config.json: the run, the policy's (and a cluster's router's) knobs, the
    scheduler's limits, the engine."""
    resolved = {
        "run": dataclasses.asdict(spec),
        "policy": {"spec": policy_spec, "name": policy.name, "label": label,
                   **_knobs(policy)},
        "scheduler": dataclasses.asdict(config),
        "engine": engine.name,
    }
    if router is not None:
        resolved["router"] = {"spec": spec.cluster.router, "name": router.name, **_knobs(router)}
    return resolved


def _knobs(plugin: object) -> dict[str, object]:
    """A policy's or router's knobs (its init fields) as config.json holds them."""
    if not dataclasses.is_dataclass(plugin):
        return {}
    return {f.name: _knob_value(getattr(plugin, f.name))
            for f in dataclasses.fields(plugin) if f.init}


def _knob_value(value: object) -> object:
    """A policy knob as config.json holds it: a string, number or bool as JSON (inf as
    null), and any other object (a callable, a predictor) as its repr, for the reader."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return to_json_value(value)
    return repr(value)
