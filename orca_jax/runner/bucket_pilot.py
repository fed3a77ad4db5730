"""The pilot run that fits a `fit:K` bucket ladder (`LimitsSpec.bucket_ladder`).

The pilot is the run itself as the simulator plays it — the same workload (its
first `PILOT_MAX_REQUESTS` requests), limits, model, hardware and cluster — under
a fixed reference policy, `PILOT_POLICY` (vllm), on a fine ladder
(`PILOT_LADDER`, multiples of 8) so that its steps hold what the policy wants
rather than what a coarse ladder rounds them to. Its step token counts go to
`core.bucket_fit.fit_token_sizes`.

Why a fixed policy and not the compared ones: every policy of a comparison (and
every policy at one rate of a sweep) must drive the same compiled steps, and a
policy's results must not depend on which others it is compared with; a pilot of
one reference policy is a function of the workload and limits alone. On the
default simulator workload the ladder fitted to vllm's steps pads orca's about as
little as vllm's (`benchmarks/bucket_ladders.py`).
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
from typing import Any, Optional, Sequence

from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import Request
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.bucket_fit import fit_token_sizes, padded_tokens, parse_fit_ladder
from orca_jax.core.step.packing import default_token_sizes, ladder_token_sizes
from orca_jax.runner.build import build_cluster, build_engine, build_workload, scheduler_config
from orca_jax.runner.disaggregated import run_disaggregated
from orca_jax.runner.progress import Progress
from orca_jax.runner.spec import RunSpec

PILOT_POLICY = "vllm"  # the reference policy whose steps the ladder is fitted to
PILOT_LADDER = "step:8"  # fine enough that a step is what the policy asked for
# ... up to this many tokens; above it (a budget no step of a pilot fills), powers of two,
# so that the pilot's sizes stay few for any budget (`packing.MAX_LADDER_SIZES`).
PILOT_FINE_TOKENS = 8 * 4096
# The pilot plays at most the workload's first requests (in arrival order): a step-size
# distribution is known well from a few thousand steps, and a whole pilot would double
# the cost of every long simulation (10^4 requests: 2.5 s -> 4.0 s of process time).
PILOT_MAX_REQUESTS = 2000


@dataclasses.dataclass(frozen=True)
class BucketFit:
    """How a `fit:K` ladder was fitted (config.json's `bucket_fit`)."""

    ladder: str  # fit:K
    token_sizes: tuple[int, ...]  # the fitted sizes: --buckets=... repeats the run
    pilot_policy: str
    pilot_ladder: str
    num_pilot_requests: int  # the workload's first ones (PILOT_MAX_REQUESTS at most)
    num_pilot_steps: int
    pilot_padding_fraction: float  # the pilot's steps padded to the fitted sizes
    pilot_s: float  # wall seconds of the pilot run and the fit

    def record(self) -> dict[str, Any]:
        """The fit as config.json holds it."""
        return dataclasses.asdict(self)

    def lines(self) -> str:
        """The fit for the terminal, in lines of at most 100 characters."""
        head = (f"buckets: {len(self.token_sizes)} sizes fitted ({self.ladder}) to a "
                f"{self.pilot_policy} pilot run's {self.num_pilot_steps} steps "
                f"({self.num_pilot_requests} requests) in "
                f"{self.pilot_s:.1f} s:")
        return head + "\n" + textwrap.fill(", ".join(str(s) for s in self.token_sizes), 100,
                                           initial_indent="  ", subsequent_indent="  ")


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


def with_fitted_buckets(spec: RunSpec, requests: Optional[Sequence[Request]] = None, *,
                        progress: bool = False) -> tuple[RunSpec, Optional[BucketFit]]:
    """The spec with its `fit:K` sizes filled in by a pilot run (as it is if it needs none).

    Args:
      spec: the run.
      requests: its workload, if already built (the pilot must see the very requests
        the runs will, e.g. a sweep's rescaled ones).
      progress: show the pilot's progress on stderr (`runner.progress`).

    Returns:
      The spec with `limits.token_buckets` the fitted sizes, and how they were fitted
      (None when nothing was fitted).
    """
    if not needs_fit(spec):
        return spec, None
    start = time.perf_counter()
    num_sizes = parse_fit_ladder(spec.limits.bucket_ladder or "")
    assert num_sizes is not None  # LimitsSpec accepts no other ladder
    budget = spec.limits.max_num_tokens
    # The host time on the clock would make the pilot, and so the ladder, vary run to run.
    pilot_sizes, pilot_ladder = pilot_token_sizes(budget)
    pilot = dataclasses.replace(spec, limits=dataclasses.replace(
        spec.limits, bucket_ladder=None, token_buckets=pilot_sizes,
        log_step_requests=False, count_host_time=False))
    workload = list(requests) if requests is not None else build_workload(spec)
    workload = workload[:PILOT_MAX_REQUESTS]  # a workload is in arrival order
    steps = _pilot_result(pilot, workload, progress).step_array("num_tokens")  # [S]
    sizes = fit_token_sizes(steps, num_sizes, budget)
    padded = padded_tokens(steps, sizes)
    fit = BucketFit(ladder=spec.limits.bucket_ladder or "", token_sizes=sizes,
                    pilot_policy=PILOT_POLICY, pilot_ladder=pilot_ladder,
                    num_pilot_requests=len(workload), num_pilot_steps=len(steps),
                    pilot_padding_fraction=(padded - int(steps.sum())) / padded if padded else 0.0,
                    pilot_s=time.perf_counter() - start)
    return dataclasses.replace(spec, limits=dataclasses.replace(spec.limits,
                                                                token_buckets=sizes)), fit


def _pilot_result(pilot: RunSpec, workload: list[Request], progress: bool) -> RunResult:
    """Runs `PILOT_POLICY` on the pilot spec: one replica, a cluster or prefill/decode pools."""
    config = scheduler_config(pilot)
    if pilot.cluster.disaggregated:  # the pilot reads its steps only: no token times
        return run_disaggregated(dataclasses.replace(pilot, log_token_times=False),
                                 PILOT_POLICY, None, config, workload)[2]
    # The pilot reads its steps only: no token log, and page counts only where nothing reads
    # pages (`Scheduler`'s and `Cluster`'s `kv_counts_only`, as `run_policy` asks).
    if pilot.cluster.colocated_cluster:
        return build_cluster(pilot, PILOT_POLICY, None, config, workload,
                             kv_counts_only=True).run()
    scheduler = Scheduler(workload, make_policy(PILOT_POLICY), build_engine(pilot, config), config,
                          log_tokens=False, kv_counts_only=True)
    bar = Progress(f"bucket pilot ({PILOT_POLICY})", len(workload), "requests") if progress \
        else None

    def each_step(s: Scheduler) -> None:
        assert bar is not None
        bar.update(s.num_done, f"{s.num_steps} steps")
        if s.done:
            bar.close(f"{s.num_steps} steps")
    return scheduler.run(progress=each_step if bar else None)
