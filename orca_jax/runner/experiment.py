"""One experiment run: a spec and a policy -> results.

`run_policy` builds the workload, the engine and the scheduler of a `RunSpec`
(`orca_jax.runner.build`), runs one policy, writes the results and returns the
summary. Comparing policies is calling it once per policy with the same spec:
the same seed gives the same workload, and the same bucket set gives the same
steps.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Mapping, Optional

from orca_jax.cluster.replicas import Cluster
from orca_jax.core.engine_api import Engine
from orca_jax.core.json_files import to_json_value
from orca_jax.core.policy import Policy, make_policy, parse_options
from orca_jax.core.request import Request
from orca_jax.core.run_result import RunResult
from orca_jax.core.scheduler import Scheduler, SchedulerConfig
from orca_jax.results.summary import summarize, write_results
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.disaggregated import num_gpus, run_disaggregated
from orca_jax.runner.spec import RunSpec


class _Progress:
    """Prints a one-line progress bar to stderr once a run has taken a few seconds."""

    def __init__(self, label: str, total: int, after_s: float = 3.0) -> None:
        self.label, self.total, self.after_s = label, total, after_s
        self.start = time.perf_counter()
        self.last = self.start
        self.shown = False

    def __call__(self, scheduler: Scheduler) -> None:
        now = time.perf_counter()
        if now - self.start < self.after_s or (now - self.last < 0.5 and not scheduler.done):
            return
        self.last = now
        done = scheduler.num_done
        width = 30
        filled = int(width * done / self.total)
        sys.stderr.write(f"\r{self.label}: [{'#' * filled}{'.' * (width - filled)}] "
                         f"{done}/{self.total} requests, {scheduler.num_steps} steps, "
                         f"{now - self.start:.0f}s")
        self.shown = True
        if scheduler.done:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_policy(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]] = None,
               *, out_dir: Optional[str] = None, requests: Optional[list[Request]] = None,
               engine: Optional[Engine] = None,
               progress: bool = True) -> tuple[dict[str, Any], RunResult]:
    """Runs one policy on the spec's workload; writes results if `out_dir` is given.

    Args:
      spec: the run's plumbing.
      policy_spec: registered name, `package.module:Class` or `file.py:Class`.
      policy_options: the policy's knobs as text (`--policy_opts`).
      out_dir: where to write config.json, requests.jsonl, steps.jsonl, summary.json.
      requests: the workload, if already built (compare builds it once).
      engine: the engine, if already built (compare shares one between policies,
        so every policy runs the very same compiled steps).
      progress: show a progress bar on runs longer than a few seconds.

    Returns:
      The summary dict and the finished run (of every replica, with several).
    """
    config = scheduler_config(spec)
    workload = requests if requests is not None else build_workload(spec)
    if spec.cluster.disaggregated:
        summary, result, cluster, pools = run_disaggregated(spec, policy_spec, policy_options,
                                                            config, workload)
        if out_dir is not None:
            decode = cluster.decode[0]
            write_results(out_dir, result, summary, {**_resolved_config(
                spec, policy_spec, decode.policy, config, decode.engine), "pools": pools})
        return summary, result
    if spec.cluster.num_replicas > 1:
        return _run_cluster(spec, policy_spec, policy_options, config, workload, out_dir)
    policy = make_policy(policy_spec, policy_options)
    engine = engine if engine is not None else build_engine(spec, config)
    scheduler = Scheduler(workload, policy, engine, config)
    result = scheduler.run(progress=_Progress(policy.name, len(workload)) if progress else None)
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s,
                        num_gpus=num_gpus(spec))
    summary.update(engine.facts())
    if out_dir is not None:
        write_results(out_dir, result, summary,
                      _resolved_config(spec, policy_spec, policy, config, engine))
    return summary, result


def _run_cluster(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]],
                 config: SchedulerConfig, workload: list[Request],
                 out_dir: Optional[str]) -> tuple[dict[str, Any], RunResult]:
    """`spec.cluster.num_replicas` simulated replicas behind `spec.cluster.router`."""
    cluster = Cluster(workload, num_replicas=spec.cluster.num_replicas,
                      router=spec.cluster.router,
                      router_options=parse_options(spec.cluster.router_opts),
                      make_policy=lambda: make_policy(policy_spec, policy_options),
                      make_engine=lambda: build_engine(spec, config), config=config)
    result = cluster.run()
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s,
                        num_gpus=num_gpus(spec))
    if out_dir is not None:
        first = cluster.replicas[0]
        write_results(out_dir, result, summary, _resolved_config(
            spec, policy_spec, first.policy, config, first.engine))
    return summary, result


def _resolved_config(spec: RunSpec, policy_spec: str, policy: Policy, config: SchedulerConfig,
                     engine: Engine) -> dict[str, Any]:
    """config.json: the run, the policy's knobs, the scheduler's limits, the engine."""
    return {
        "run": dataclasses.asdict(spec),
        "policy": {"spec": policy_spec, "name": policy.name,
                   **({f.name: _knob_value(getattr(policy, f.name))
                       for f in dataclasses.fields(policy) if f.init}
                      if dataclasses.is_dataclass(policy) else {})},
        "scheduler": dataclasses.asdict(config),
        "engine": engine.name,
    }


def _knob_value(value: object) -> object:
    """A policy knob as config.json holds it: a string, number or bool as JSON (inf as
    null), and any other object (a callable, a predictor) as its repr, for the reader."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return to_json_value(value)
    return repr(value)
