"""One experiment run: a spec and a policy -> results.

`run_policy` builds the workload, the engine and the scheduler of a `RunSpec`
(`orca_jax.runner.build`), runs one policy, writes the results and returns the
summary. Comparing policies is calling it once per policy with the same spec:
the same seed gives the same workload, and the same bucket set gives the same
steps.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import numpy as np
from absl import logging
from numpy.typing import NDArray

from orca_jax.cluster.routing import Router
from orca_jax.core.api.policy import Policy, PolicyLoadError, make_policy
from orca_jax.core.json_files import to_json_value
from orca_jax.core.loop.leap import leap_counts
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.requests.request import Request
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine
from orca_jax.results.row_lines import (
    iter_request_lines,
    iter_step_lines,
    request_lines_from_streamed,
    reusable_streamed_rows,
)
from orca_jax.results.run_folder import ResultsWriteError, RunFolder
from orca_jax.results.summary import (
    flatten,
    iter_request_rows,
    summarize_run,
)
from orca_jax.runner.bucket_pilot import BucketFit, PilotPolicy, needs_fit, with_fitted_buckets
from orca_jax.runner.build import (
    build_cluster,
    build_engine,
    build_workload,
    profile_table_record,
    scheduler_config,
)
from orca_jax.runner.disaggregated import num_gpus, run_disaggregated, token_times
from orca_jax.runner.live_results import StreamResults
from orca_jax.runner.progress import Progress
from orca_jax.runner.settings import effective_settings
from orca_jax.runner.spec import RunSpec
from orca_jax.runner.thrash_watch import ThrashWatch

if TYPE_CHECKING:  # the cluster's loop is imported by the runs that build a cluster only
    from orca_jax.cluster.replicas import Cluster
    from orca_jax.results.qoe import TokenTimes  # a --log_token_times run's only

# `_RunProgress` moves its count every this many iterations (and at the run's end).
UPDATE_EVERY_STEPS = 64


class _RunProgress:
    """A periodic observer (`_observers`): requests done of the workload (`Progress`)."""

    # Every this many iterations and at the end: a bar or a log line moves at most a few
    # times a second, and the note costs a formatting each call.
    every = UPDATE_EVERY_STEPS

    def __init__(self, label: str, total: int) -> None:
        self.progress = Progress(f"run {label}", total, "requests")

    def __call__(self, scheduler: Scheduler) -> None:
        self.progress.update(scheduler.num_done, f"{scheduler.num_steps} steps")
        if scheduler.done:
            self.progress.close(f"{scheduler.num_steps} steps")


def run_policy(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]] = None,
               *, out_dir: Optional[str] = None, requests: Optional[list[Request]] = None,
               engine: Optional[Engine] = None, progress: bool = True,
               label: Optional[str] = None,
               bucket_fit: Optional[BucketFit] = None,
               kv_counts_only: bool = True) -> tuple[dict[str, Any], RunResult]:
    """Runs one policy on the spec's workload; writes results if `out_dir` is given.

    The results folder is checked before anything is built, staged beside
    `out_dir` while the run goes (requests.jsonl and steps.jsonl streamed,
    status.json `running`) and moved into place when it ends: finished, or
    failed with its partial logs (`orca_jax.results.run_folder`).

    Args:
      spec: the run's plumbing.
      policy_spec: registered name, `package.module:Class` or `file.py:Class`.
      policy_options: the policy's knobs as text (`--policy_opts`).
      out_dir: where to write config.json, requests.jsonl, steps.jsonl, summary.json,
        status.json (and tenants.jsonl, replicas.jsonl where the run has them).
      requests: the workload, if already built (compare builds it once).
      engine: the engine, if already built (compare shares one between policies,
        so every policy runs the very same compiled steps).
      progress: show progress on runs longer than a few seconds (`runner.progress`).
      label: the run's name in its results (summary.json's `policy`; config.json's
        `policy.label`): compare's and sweep's label; default the policy's name.
      bucket_fit: how the spec's `fit:K` sizes were fitted, for config.json, when the
        caller fitted them (compare fits once for every policy); a spec whose sizes are
        not fitted yet is fitted here to this policy's own pilot (`runner.bucket_pilot`).
      kv_counts_only: `Scheduler`'s: keep KV page counts only where nothing can read
        pages (the same results, faster), on one replica or a colocated cluster's
        replicas without migration (`Cluster`'s); False keeps the full page table.

    Returns:
      The summary dict and the finished run (of every replica, with several).

    Raises:
      OutDirError: `out_dir` cannot hold the results (before anything runs).
      ResultsWriteError: writing failed (e.g. disk full); `out_dir` is as it was.
    """
    folder = (RunFolder(out_dir, label=label or policy_spec) if out_dir is not None
              else None)
    try:
        workload = requests if requests is not None else build_workload(spec)
        if needs_fit(spec):
            spec, bucket_fit = with_fitted_buckets(
                spec, workload, progress=progress,
                policies=[PilotPolicy(label or policy_spec, policy_spec, policy_options or {})])
        config = scheduler_config(spec)
        if spec.cluster.disaggregated:
            pass  # its pools are built by `run_disaggregated`, in `_run_disaggregated`
        elif spec.cluster.colocated_cluster:
            cluster = build_cluster(spec, policy_spec, policy_options, config, workload,
                                    kv_counts_only=kv_counts_only)
        else:
            policy = make_policy(policy_spec, policy_options)
            engine = (engine if engine is not None
                      else build_engine(spec, config, workload=workload))
            # The results need no log of every token (16 bytes a token: 10^6 requests, 1 GB)
            # but to write each request's token times (`--log_token_times`).
            scheduler = Scheduler(workload, policy, engine, config,
                                  log_tokens=spec.log_token_times,
                                  kv_counts_only=kv_counts_only)
    except BaseException:
        if folder is not None:
            folder.discard()  # nothing ran: the old folder stays as it was
        raise
    if spec.cluster.disaggregated:
        return _run_disaggregated(spec, policy_spec, policy_options, config, workload, folder,
                                  label, bucket_fit)
    if spec.cluster.colocated_cluster:
        return _run_cluster(spec, policy_spec, config, cluster, folder, label, progress,
                            len(workload), bucket_fit)
    label = label or policy.name
    bar = _RunProgress(label, len(workload)) if progress else None
    stream = None
    resolved = resolved_config(spec, policy_spec, policy, config, engine, label,
                               bucket_fit=bucket_fit)
    if folder is not None:
        folder.begin(resolved)
        stream = StreamResults(folder, scheduler)
    try:
        result = scheduler.run(progress=_observers(bar, stream, ThrashWatch(label)))
        if stream is not None:
            stream.flush()  # the steps and requests since its last flush
        leaper = scheduler.executor.leaper
        if leaper is not None:  # how much the host skipped (the results are the same)
            logging.info("run %s: %s", label, leap_counts([leaper], scheduler.num_steps))
    except BaseException as error:
        if folder is not None and not isinstance(error, ResultsWriteError):
            _fail(folder, error, stream, scheduler.result, scheduler.num_steps,
                  scheduler.now_s)
        raise
    # Its logs are in the result now: free them before the summary. The scheduler's parts
    # refer to each other (its view, its executor), so only the cycle collector frees
    # them, and that might not run before the summary (10^6 requests: ~230 MB held).
    line_of = stream.request_line_of if stream is not None else None
    del scheduler, stream
    gc.collect()
    try:
        times = token_times(spec, result)
        summary, tables = summarize_run(result, ttft_slo_s=spec.ttft_slo_s,
                                        tpot_slo_s=spec.tpot_slo_s,
                                        num_gpus=num_gpus(spec), token_times=times,
                                        program_slo_s=spec.program_slo_s)
        summary.update(flatten(engine.facts()))
        summary["policy"] = label
        if folder is not None:
            # The streamed steps are the file; the requests, streamed as they finished,
            # are written again in arrival order, each row now with every field. With
            # step requests logged, the run's end may add removals to the last step
            # (`RunRecord.flush_removed`) after it streamed: the steps are written again.
            rewrite_steps = config.features.log_step_requests
            if not rewrite_steps:
                folder.keep_streamed("steps.jsonl")
            # The profiled clock's table (measured only at warm-up, after config.json was
            # begun), so a rerun in another process can price every step alike.
            table = profile_table_record(engine, str(folder.target),
                                         write_dir=str(folder.staging))
            if table is not None:
                folder.write_json("config.json", {**resolved, "profile_table": table})
            finish_run_folder(folder, result, summary, tables, write_steps=rewrite_steps,
                              token_times=times, streamed_line_of=line_of)
    except BaseException as error:
        if folder is not None and not isinstance(error, ResultsWriteError):
            _fail(folder, error, None, lambda: result, result.num_steps, result.virtual_end_s)
        raise
    return summary, result


def _observers(*observers: Optional[Callable[[Scheduler], None]]
               ) -> Optional[Callable[[Scheduler], None]]:
    """One per-iteration callback calling each given observer in turn (None if none):
    one with an `every` attribute only every that many iterations (counted from 1) and at
    the run's end (`scheduler.done`), the others every iteration. The periodic ones'
    own calls cost more per iteration than what they do there (the bar moves every 64
    iterations, the thrash check every 256), so the gate is asked once for all of them,
    at the greatest common divisor of their periods."""
    given = [o for o in observers if o is not None]
    if not given:
        return None
    each = [o for o in given if getattr(o, "every", None) is None]
    periodic = [(o, int(o.every)) for o in given if getattr(o, "every", None) is not None]
    stride = math.gcd(*[every for _, every in periodic]) if periodic else 0
    num_calls = 0

    def each_step(scheduler: Scheduler) -> None:
        nonlocal num_calls
        num_calls += 1
        for observer in each:
            observer(scheduler)
        if stride and (num_calls % stride == 0 or scheduler.done):
            done = scheduler.done
            for observer, every in periodic:
                if num_calls % every == 0 or done:
                    observer(scheduler)
    return each_step


def finish_run_folder(folder: RunFolder, result: RunResult, summary: Mapping[str, Any],
                      tables: Mapping[str, Any], *, write_steps: bool = False,
                      token_times: Optional[TokenTimes] = None,
                      streamed_line_of: Optional[NDArray[np.int64]] = None) -> None:
    """Writes the finished run's files into its folder and moves it into place (each
    request's row with its `token_times` and `qoe` when given).

    With the requests streamed (`streamed_line_of`: `[N]` each one's line in the
    streamed requests.jsonl, -1 if not there), a row whose streamed line is its final
    one is not formatted again: the streamed file is kept as it is when it holds every
    row's final line in arrival order, and is otherwise rewritten from its own lines.
    """
    reusable = (None if streamed_line_of is None
                else reusable_streamed_rows(result, streamed_line_of, token_times))
    if reusable is not None and reusable.all() and np.array_equal(
            streamed_line_of, np.arange(result.num_requests)):
        folder.keep_streamed("requests.jsonl")
    elif reusable is not None and reusable.any():
        folder.rewrite_streamed("requests.jsonl", lambda streamed: request_lines_from_streamed(
            result, streamed, streamed_line_of, reusable))
    else:
        folder.write_lines("requests.jsonl", iter_request_lines(result, token_times))
    if write_steps:
        folder.write_lines("steps.jsonl", iter_step_lines(result))
    for name, rows in tables.items():
        folder.write_rows(f"{name}.jsonl", rows)
    folder.write_json("summary.json", summary)
    folder.finish(num_steps=result.num_steps, virtual_time_s=result.virtual_end_s)


def _fail(folder: RunFolder, error: BaseException, stream: Optional[StreamResults],
          partial: Callable[[], RunResult], step: int, now_s: float) -> None:
    """Marks the run failed, its logs as far as it got (every request's row, with its
    status then), and moves it into place; the run's own error is what propagates."""
    try:
        if stream is not None:
            stream.flush()
            try:
                rows = iter_request_rows(partial())
            except Exception:  # noqa: BLE001  (a scheduler broken mid-step: keep what streamed)
                rows = None
            if rows is not None:
                folder.write_rows("requests.jsonl", rows)
        folder.fail(error, step=step, virtual_time_s=now_s)
    except ResultsWriteError:
        pass  # the folder was removed; the run's error says what went wrong


def _run_cluster(spec: RunSpec, policy_spec: str, config: SchedulerConfig, cluster: Cluster,
                 folder: Optional[RunFolder], label: Optional[str], progress: bool,
                 num_requests: int,
                 bucket_fit: Optional[BucketFit]) -> tuple[dict[str, Any], RunResult]:
    """Runs a cluster and writes its results.

    A cluster has no per-step hook: its folder says `running` until the end, and its
    logs are written whole when the run ends (on a failure: config.json and status.json
    `failed`, no logs).
    """
    first = cluster.replicas[0]
    label = label or first.policy.name
    if folder is not None:
        folder.begin(resolved_config(spec, policy_spec, first.policy, config, first.engine,
                                     label, cluster.router, bucket_fit), stream=False)
    bar = (Progress(f"run {label} on {spec.cluster.num_replicas} replicas", num_requests,
                    "requests") if progress else None)
    try:
        result = cluster.run(progress=bar.update if bar else None)
        if bar:
            bar.close()
        leapers = [r.executor.leaper for r in cluster.replicas
                   if getattr(r.executor, "leaper", None) is not None]
        if leapers:  # how much the host skipped, all replicas together (the same results)
            logging.info("run %s: %s", label, leap_counts(
                leapers, sum(r.num_steps for r in cluster.replicas)))
        times = token_times(spec, result)
        summary, tables = summarize_run(result, ttft_slo_s=spec.ttft_slo_s,
                                        tpot_slo_s=spec.tpot_slo_s,
                                        num_gpus=num_gpus(spec), token_times=times,
                                        program_slo_s=spec.program_slo_s)
        summary["policy"] = label
        if cluster.migrator is not None:  # a rebalancer's run: its migrations too
            from orca_jax.cluster.migration import migration_figures

            summary.update(migration_figures(cluster.migrator))
            tables = {**tables, "migrations": [m.row() for m in cluster.migrator.log]}
        if cluster.elastic is not None:  # a planner's run: its replicas over time too
            from orca_jax.cluster.elastic import planner_figures

            attainment = summary.get("slo_attainment")
            met = None if attainment is None else round(attainment * len(workload_of(cluster)))
            summary.update(planner_figures(cluster.elastic, result.virtual_end_s, met))
            tables = {**tables, "replicas": cluster.elastic.timeline()}
        if folder is not None:
            finish_run_folder(folder, result, summary, tables, write_steps=True, token_times=times)
    except BaseException as error:
        if folder is not None and not isinstance(error, ResultsWriteError):
            _fail(folder, error, None, cluster.replicas[0].result,
                  max(r.num_steps for r in cluster.replicas),
                  max(r.now_s for r in cluster.replicas))
        raise
    return summary, result


def workload_of(cluster: Cluster) -> range:
    """The cluster's requests by index."""
    return range(len(cluster.replicas[0].table))


def _run_disaggregated(spec: RunSpec, policy_spec: str,
                       policy_options: Optional[Mapping[str, str]], config: SchedulerConfig,
                       workload: list[Request], folder: Optional[RunFolder],
                       label: Optional[str],
                       bucket_fit: Optional[BucketFit]) -> tuple[dict[str, Any], RunResult]:
    """Runs the spec's prefill and decode pools (`runner.disaggregated`) and writes their
    results, as a cluster's: whole when the run ends (on a failure: status.json
    `failed`, no logs)."""
    try:
        summary, tables, result, cluster, pools, times = run_disaggregated(
            spec, policy_spec, policy_options, config, workload)
    except PolicyLoadError:
        if folder is not None:
            folder.discard()  # a pool's policy did not load: nothing ran
        raise
    except BaseException as error:
        if folder is not None:
            try:
                folder.fail(error, step=0, virtual_time_s=0.0)
            except ResultsWriteError:
                pass  # the folder was removed; the run's error says what went wrong
        raise
    decode = cluster.decode[0]
    label = label or decode.policy.name
    summary["policy"] = label
    if folder is not None:
        folder.begin({**resolved_config(spec, policy_spec, decode.policy, config,
                                        decode.engine, label, bucket_fit=bucket_fit),
                      "pools": pools}, stream=False)
        finish_run_folder(folder, result, summary, tables, write_steps=True, token_times=times)
    return summary, result


def resolved_config(spec: RunSpec, policy_spec: str, policy: Policy, config: SchedulerConfig,
                    engine: Engine, label: str, router: Optional[Router] = None,
                    bucket_fit: Optional[BucketFit] = None) -> dict[str, Any]:
    """config.json: the run, the policy's (and a cluster's router's) knobs, the
    scheduler's limits, the policy's effective settings (`runner.settings`), the
    engine, and how a `fit:K` ladder was fitted."""
    resolved = {
        "run": dataclasses.asdict(spec),
        "policy": {"spec": policy_spec, "name": policy.name, "label": label,
                   **_knobs(policy)},
        "scheduler": dataclasses.asdict(config),
        # What the policy's steps ran under: its knobs capped by the scheduler's limits.
        "settings": effective_settings(policy, config),
        "engine": engine.name,
    }
    if router is not None:
        resolved["router"] = {"spec": spec.cluster.router, "name": router.name, **_knobs(router)}
        stages = getattr(router, "stages", None)  # a `chain` router's, each with its knobs
        if stages:
            resolved["router"]["stages"] = [{"kind": stage.kind, "name": stage.name,
                                             **_knobs(stage)} for stage in stages]
    if bucket_fit is not None:
        resolved["bucket_fit"] = bucket_fit.record()
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
