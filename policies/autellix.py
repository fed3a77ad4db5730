"""Autellix's program-level schedulers (Luo et al., arXiv 2502.13965): PLAS and ATLAS.

An agent program is many LLM calls; a call's own size says little about how
long its program has been served. Autellix ranks every call by its *program's*
attained service, so that short programs (few, small calls so far) overtake
long ones, as least-attained-service does for jobs, without knowing any
program's length:

* `plas` (program-level attained service): the tokens served to the program's
  calls so far, done ones and live ones (`SchedulerView.programs.attained`), for
  sequential programs;
* `atlas` (attained service along the critical path): the longest chain of
  calls so far (`programs.critical_path`), for programs with parallel threads:
  a program's threads running side by side do not push each other down, only
  the chain that bounds its completion does.

As Autellix, ranks are discretized into levels (queue k holds the programs whose
service lies in [base_quantum * growth**(k-1), base_quantum * growth**k)), first
come first served inside a level (request index: arrival order), so a call is
not reordered on every token. A request of no program ranks by its own service.

Every step the running and waiting calls are ranked together and run best
first while seats, budget and pages last (`plan_in_order`): a running call
that falls below the cut is paused (it keeps its KV); when pages run out the
lowest-ranked running calls are preempted by recompute; a waiting call never
preempts (ranks fall as calls run: admissions and preemptions would chase each
other). Both opt in to prefix caching, as vLLM under Autellix: a program's
calls share its history, and without the cache every call computes it again
(on a parallel-program load plas served 137 output tokens/s without it, vllm 297
and plas 293 with it: benchmarks/results/programs_first_look.txt).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register
from policies._common import candidates


@dataclasses.dataclass(kw_only=True)
class ProgramLevels(Policy):
    """Ranks calls by a program-level service, in levels (the knobs plas and atlas share).

    Attributes:
      base_quantum: tokens of service the top level holds.
      quantum_growth: each level holds this many times the service of the one above.
      num_levels: levels in all (the last holds the rest).
      enable_prefix_caching: opt in to the core's prefix caching (Autellix runs on vLLM,
        whose prefix cache holds a program's history between its calls); it decides
        only under the run's `--prefix_caching=policy` (the default).
    """

    base_quantum: float = 2048.0
    quantum_growth: float = 2.0
    num_levels: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_knob: ClassVar[str] = "enable_prefix_caching"
    # [N] the most service each request has been ranked by (see `attained`).
    _served: Optional[NDArray[np.float64]] = dataclasses.field(default=None, init=False,
                                                               repr=False)

    @property
    def prefix_caching(self) -> bool:  # the core reads this (see `Policy.prefix_caching`)
        return self.enable_prefix_caching

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_quantum) and self.base_quantum > 0):
            raise ValueError(f"policy {self.name}: base_quantum must be a finite number > 0, "
                             f"got {self.base_quantum}")
        if not (math.isfinite(self.quantum_growth) and self.quantum_growth > 1):
            raise ValueError(f"policy {self.name}: quantum_growth must be a finite number > 1, "
                             f"got {self.quantum_growth}")
        if self.num_levels < 1:
            raise ValueError(f"policy {self.name}: num_levels must be >= 1, got "
                             f"{self.num_levels}")

    @abc.abstractmethod
    def service(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` the service each request is ranked by."""

    def attained(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` the service each request ranks by: the most its `service` has been.

        Service attained is never taken back. `service` counts a call still in its prompt
        by the tokens it has computed, which a recompute preemption sets back to 0 (or to
        its cache hit): a long prompt past `base_quantum` fell to the top level when
        preempted, was admitted again over the call that preempted it (whose service had
        grown past its own meanwhile), then preempted again, and the two chased each
        other with no token gained (19 requests of 3,000-token prompts, one seat: the
        no-progress rule after 313 preemptions).
        """
        service = self.service(view, ids)
        if self._served is None:
            self._served = np.zeros(len(view.requests), dtype=np.float64)
        service = np.maximum(service, self._served[ids])
        self._served[ids] = service
        return service

    def levels(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """`[n]` each request's level (0 first) from its `attained` service."""
        service = self.attained(view, ids)
        ratio = np.maximum(service / self.base_quantum, 1.0)
        level = np.where(service < self.base_quantum, 0,
                         np.floor(np.log(ratio) / math.log(self.quantum_growth)) + 1)
        return np.minimum(level, self.num_levels - 1).astype(np.int64)

    def rank(self, view: SchedulerView) -> NDArray[np.int64]:
        """`[k]` every candidate (running and waiting), best first: level, then index."""
        ids = candidates(view)
        return ids[np.lexsort((ids, self.levels(view, ids)))]

    def schedule(self, view: SchedulerView) -> StepPlan:
        return plan_in_order(view, self.rank(view), admission_preempts=False)


def _own_service(view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
    """`[n]` tokens each request has been served (the rank of a request of no program)."""
    requests = view.requests
    generated = requests.num_generated[ids]
    return np.where(generated > 0, requests.prompt_len[ids] + generated,
                    requests.num_computed[ids]).astype(np.float64)


@register("plas")
@dataclasses.dataclass(kw_only=True)
class PLAS(ProgramLevels):
    """Program-level least attained service (Autellix's PLAS), for sequential programs."""

    def service(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        programs = view.programs
        return _own_service(view, ids) if programs is None else programs.attained(ids)


@register("atlas")
@dataclasses.dataclass(kw_only=True)
class ATLAS(ProgramLevels):
    """Least attained service along each program's critical path (Autellix's ATLAS), for
    programs with parallel threads."""

    def service(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        programs = view.programs
        return _own_service(view, ids) if programs is None else programs.critical_path(ids)
