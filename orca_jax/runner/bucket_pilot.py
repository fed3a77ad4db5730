"""The pilot runs that fit a `fit:K` bucket ladder (`LimitsSpec.bucket_ladder`).

A pilot is the run itself as the simulator plays it — the same whole workload,
limits, model, hardware and cluster — under one of the policies the ladder is for,
priced ragged (`step_padding="ragged"`: real tokens only) on a fine ladder
(`PILOT_LADDER`, multiples of 8), so that its steps hold what the policy wants
rather than what a coarse ladder rounds them to, and cost what an ideal engine
would take. Every policy the ladder is for gets a pilot: a compare's policies, a
sweep's, a single run's own. Their step token counts go together to
`core.bucket_fit.fit_token_sizes`, each policy's steps weighed by the inverse of
its real tokens, so that the ladder pads each policy's steps alike (a policy that
ran fewer, larger steps counts as much as one of many small ones), no size more
than 2x the one below (`bucket_fit.MAX_SIZE_RATIO`), the largest the budget.

Why all of them (issue 50): a ladder fitted to one reference policy's steps (vllm,
before) charged the others for steps it never ran: on a shared-prefix workload at
8 req/s sarathi's steps were 56% padding and its TTFT p50 22 s against 0.19 s
ragged. The price is that a policy's results depend on which others share its
ladder (`compare --policies=orca` and `--policies=orca,sarathi` may run orca on
different sizes); within one comparison every policy still drives the same sizes.

A pilot priced ragged is the policy's ragged run (the bucket sizes change the
padding and nothing else there), so each pilot's summary is that policy's figures
without padding, which `compare` ranks against the padded ones for free
(`PilotRun.ragged`).
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import Request
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.bucket_fit import (
    fit_token_sizes,
    padded_tokens,
    parse_fit_ladder,
    widest_ratio,
)
from orca_jax.core.step.packing import default_token_sizes, ladder_token_sizes
from orca_jax.results.summary import summarize
from orca_jax.runner.build import build_cluster, build_engine, build_workload, scheduler_config
from orca_jax.runner.disaggregated import run_disaggregated
from orca_jax.runner.engine_spec import SimEngineSpec
from orca_jax.runner.progress import Progress
from orca_jax.runner.spec import RunSpec

PILOT_LADDER = "step:8"  # fine enough that a step is what the policy asked for
# ... up to this many tokens; above it (a budget no step of a pilot fills), powers of two,
# so that the pilot's sizes stay few for any budget (`packing.MAX_LADDER_SIZES`).
PILOT_FINE_TOKENS = 8 * 4096
PILOT_PADDING = "ragged"  # how a pilot's steps are priced: what an ideal engine takes
# The figures of each pilot (its policy's ragged run) that config.json keeps and compare
# ranks the padded runs against.
RAGGED_FIELDS = ("output_tok_s", "throughput_req_s", "ttft_p50_s", "ttft_p99_s",
                 "latency_p50_s", "num_finished")


@dataclasses.dataclass(frozen=True)
class PilotPolicy:
    """A policy the ladder is fitted for: its label (a compare's or sweep's), its spec and
    knobs (as `run_policy` takes them)."""

    label: str
    spec: str
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """What makes two pilots the same run: the policy and its knobs, not the label."""
        return self.spec, tuple(sorted(self.options.items()))


@dataclasses.dataclass(frozen=True)
class PilotRun:
    """One policy's pilot: its steps under the fitted sizes, and its ragged figures."""

    labels: tuple[str, ...]  # the labels that run this policy with these knobs
    num_steps: int
    padding_fraction: float  # its pilot's steps padded to the fitted sizes
    ragged: Mapping[str, Any]  # `RAGGED_FIELDS` of its run priced ragged (the pilot)


@dataclasses.dataclass(frozen=True)
class BucketFit:
    """How a `fit:K` ladder was fitted (config.json's `bucket_fit`)."""

    ladder: str  # fit:K
    token_sizes: tuple[int, ...]  # the fitted sizes: --buckets=... repeats the run
    pilot_policies: tuple[str, ...]  # the labels of the policies it was fitted to
    pilot_ladder: str
    pilot_padding: str  # the pilots' pricing (`PILOT_PADDING`)
    num_pilot_requests: int  # the whole workload
    num_pilot_steps: int  # of every pilot
    pilot_padding_fraction: float  # every pilot's steps padded to the fitted sizes
    widest_ratio: float  # the largest ratio of adjacent sizes (at most 2)
    pilot_s: float  # wall seconds of the pilot runs and the fit
    pilots: tuple[PilotRun, ...] = ()

    def record(self) -> dict[str, Any]:
        """The fit as config.json holds it."""
        return dataclasses.asdict(self)

    def ragged(self, label: str) -> Optional[Mapping[str, Any]]:
        """The ragged figures of the policy under `label` (None if it had no pilot)."""
        return next((pilot.ragged for pilot in self.pilots if label in pilot.labels), None)

    def describe(self) -> str:
        """The ladder in a phrase: its sizes and whose pilots they were fitted to."""
        sizes = self.token_sizes
        return (f"{self.ladder}: {len(sizes)} sizes {sizes[0]}-{sizes[-1]}, adjacent ones at "
                f"most {self.widest_ratio:.2g}x apart, fitted to the {self.pilot_padding} "
                f"pilot run{'s' if len(self.pilots) > 1 else ''} of "
                f"{', '.join(self.pilot_policies)} over all {self.num_pilot_requests} "
                f"requests ({self.num_pilot_steps} steps, {self.pilot_s:.1f} s; the pilots "
                f"pad {self.pilot_padding_fraction:.1%})")

    def lines(self) -> str:
        """The fit for the terminal, in lines of at most 100 characters."""
        return (textwrap.fill("buckets: " + self.describe() + ":", 100,
                              subsequent_indent="  ") + "\n"
                + textwrap.fill(", ".join(str(s) for s in self.token_sizes), 100,
                                initial_indent="  ", subsequent_indent="  "))


def ladder_line(spec: RunSpec, fit: Optional[BucketFit], reason: str) -> str:
    """The one line saying which ladder a (fitted) spec runs and why (`reason`: the flag
    that chose it)."""
    if fit is not None:
        return f"ladder: {fit.describe()} ({reason})"
    sizes = token_sizes(spec)
    return (f"ladder: {len(sizes)} sizes {sizes[0]}-{sizes[-1]}, adjacent ones at most "
            f"{widest_ratio(sizes):.2g}x apart ({reason})")


def needs_fit(spec: RunSpec) -> bool:
    """Whether the spec's ladder is `fit:K` and its sizes are not fitted yet."""
    return spec.limits.bucket_ladder is not None and spec.limits.token_buckets is None


def token_sizes(spec: RunSpec) -> tuple[int, ...]:
    """The step sizes a (fitted) spec compiles: its buckets, or the powers of two."""
    limits = spec.limits
    return tuple(limits.token_buckets or default_token_sizes(limits.max_num_tokens))


def pilot_token_sizes(max_num_tokens: int) -> tuple[tuple[int, ...], str]:
    """The pilot's step sizes and their rule: `PILOT_LADDER` up to `PILOT_FINE_TOKENS`, then
    powers of two up to the budget (so the sizes are few however large the budget is)."""
    if max_num_tokens <= PILOT_FINE_TOKENS:
        return ladder_token_sizes(PILOT_LADDER, max_num_tokens), PILOT_LADDER
    fine = ladder_token_sizes(PILOT_LADDER, PILOT_FINE_TOKENS)
    coarse = default_token_sizes(max_num_tokens, smallest=2 * PILOT_FINE_TOKENS)
    return fine + coarse, f"{PILOT_LADDER} to {PILOT_FINE_TOKENS}, pow2 above"


def pilot_policies(runs: Sequence[tuple[str, str, Optional[Mapping[str, str]]]]
                   ) -> list[PilotPolicy]:
    """The pilots of (label, policy spec, knobs) runs."""
    return [PilotPolicy(label, spec, dict(options or {})) for label, spec, options in runs]


def with_fitted_buckets(spec: RunSpec, requests: Optional[Sequence[Request]] = None, *,
                        policies: Sequence[PilotPolicy], progress: bool = False
                        ) -> tuple[RunSpec, Optional[BucketFit]]:
    """The spec with its `fit:K` sizes filled in by the policies' pilot runs (as it is if it
    needs none).

    Args:
      spec: the run.
      requests: its workload, if already built (the pilots must see the very requests
        the runs will, e.g. a sweep's rescaled ones).
      policies: the policies that will share the ladder (one pilot for each policy with
        the same knobs, however many labels run it).
      progress: show the pilots' progress on stderr (`runner.progress`).

    Returns:
      The spec with `limits.token_buckets` the fitted sizes, and how they were fitted
      (None when nothing was fitted).

    Raises:
      ValueError: no policies.
    """
    if not needs_fit(spec):
        return spec, None
    if not policies:
        raise ValueError("with_fitted_buckets: a fit:K ladder needs the policies it is for")
    start = time.perf_counter()
    num_sizes = parse_fit_ladder(spec.limits.bucket_ladder or "")
    assert num_sizes is not None  # LimitsSpec accepts no other ladder
    budget = spec.limits.max_num_tokens
    pilot = pilot_spec(spec)
    workload = list(requests) if requests is not None else build_workload(spec)
    runs: dict[tuple, list[str]] = {}  # a policy with its knobs -> its labels
    for policy in policies:
        runs.setdefault(policy.key, []).append(policy.label)
    steps, summaries = [], []
    for (policy_spec, options), labels in runs.items():
        result, summary = _pilot_result(pilot, policy_spec, dict(options), labels[0],
                                        workload, progress)
        steps.append(result.step_array("num_tokens"))  # [S_p]
        summaries.append(summary)
    # Each policy's steps weigh the inverse of its real tokens: the fit minimises the sum
    # of the policies' padded-over-real ratios, so no policy counts for more because it ran
    # more or smaller steps.
    weights = np.concatenate([np.full(s.size, 1.0 / max(int(s.sum()), 1)) for s in steps])
    every = np.concatenate(steps) if steps else np.zeros(0, np.int64)  # [S]
    sizes = fit_token_sizes(every, num_sizes, budget, weights=weights)
    pilots = tuple(PilotRun(labels=tuple(labels), num_steps=int(s.size),
                            padding_fraction=_padding_fraction(s, sizes),
                            ragged={key: summary.get(key) for key in RAGGED_FIELDS})
                   for labels, s, summary in zip(runs.values(), steps, summaries))
    fit = BucketFit(ladder=spec.limits.bucket_ladder or "", token_sizes=sizes,
                    pilot_policies=tuple(labels[0] for labels in runs.values()),
                    pilot_ladder=pilot_token_sizes(budget)[1], pilot_padding=PILOT_PADDING,
                    num_pilot_requests=len(workload), num_pilot_steps=int(every.size),
                    pilot_padding_fraction=_padding_fraction(every, sizes),
                    widest_ratio=widest_ratio(sizes), pilot_s=time.perf_counter() - start,
                    pilots=pilots)
    return dataclasses.replace(spec, limits=dataclasses.replace(spec.limits,
                                                                token_buckets=sizes)), fit


def pilot_spec(spec: RunSpec) -> RunSpec:
    """The spec a pilot runs: the fine ladder (`pilot_token_sizes`), priced ragged, with no
    host time on the clock (it would make the pilot, and so the ladder, vary run to run)
    and no step requests logged (nothing reads them)."""
    sizes, _ = pilot_token_sizes(spec.limits.max_num_tokens)
    engine = spec.engine
    if isinstance(engine, SimEngineSpec):  # a fit:K ladder is the simulator's (RunSpec)
        engine = dataclasses.replace(engine, step_padding=PILOT_PADDING)
    return dataclasses.replace(spec, engine=engine, limits=dataclasses.replace(
        spec.limits, bucket_ladder=None, token_buckets=sizes, log_step_requests=False,
        count_host_time=False))


def _padding_fraction(steps: np.ndarray, sizes: tuple[int, ...]) -> float:  # steps: [S]
    """The padded tokens' share of these steps padded to `sizes`."""
    padded = padded_tokens(steps, sizes)
    return (padded - int(steps.sum())) / padded if padded else 0.0


def _pilot_result(pilot: RunSpec, policy_spec: str, options: Mapping[str, str], label: str,
                  workload: list[Request], progress: bool) -> tuple[RunResult, dict[str, Any]]:
    """Runs one policy on the pilot spec (one replica, a cluster or prefill/decode pools):
    its result and summary."""
    config = scheduler_config(pilot)
    if pilot.cluster.disaggregated:  # the pilot reads its steps only: no token times
        ran = run_disaggregated(dataclasses.replace(pilot, log_token_times=False),
                                policy_spec, options, config, workload)
        return ran[2], ran[0]
    # The pilot reads its steps and summary only: no token log, and page counts only where
    # nothing reads pages (`Scheduler`'s and `Cluster`'s `kv_counts_only`, as `run_policy`
    # asks).
    if pilot.cluster.colocated_cluster:
        result = build_cluster(pilot, policy_spec, options, config, workload,
                               kv_counts_only=True).run()
        return result, summarize(result)
    scheduler = Scheduler(workload, make_policy(policy_spec, options),
                          build_engine(pilot, config), config, log_tokens=False,
                          kv_counts_only=True)
    bar = Progress(f"bucket pilot ({label})", len(workload), "requests") if progress \
        else None

    def each_step(s: Scheduler) -> None:
        assert bar is not None
        bar.update(s.num_done, f"{s.num_steps} steps")
        if s.done:
            bar.close(f"{s.num_steps} steps")
    result = scheduler.run(progress=each_step if bar else None)
    return result, summarize(result)
