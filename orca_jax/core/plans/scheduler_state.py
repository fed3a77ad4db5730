"""SchedulerState: what the view and the plan checks read of a running scheduler.

`Scheduler` builds a `SchedulerView` and calls `check_plan` (`checked_counts`); both read its live
state. They depend on this narrow protocol instead of on `Scheduler` itself,
so the imports point one way (scheduler -> view, plan_checks -> this module)
and a test can hand either of them a small fake. Every member is read only.
"""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv import KVCapacity, KVConfig, KVPool, PreemptionCosts
from orca_jax.core.plans.limits import SLOTargets, StepLimits
from orca_jax.core.requests.request_table import RequestTable
from orca_jax.core.step.engine_api import Engine
from orca_jax.core.step.packing import BucketConfig
from orca_jax.core.step.sampling import SamplingConfig


class SchedulerParts(Protocol):
    """The parts of the scheduler's config that are read (a `SchedulerConfig` has them)."""

    @property
    def limits(self) -> StepLimits: ...

    @property
    def kv(self) -> KVConfig: ...

    @property
    def sampling(self) -> SamplingConfig: ...

    @property
    def slo(self) -> SLOTargets: ...


class PolicyTraits(Protocol):
    """What the checks read of the policy: its name (for errors) and its release mode."""

    @property
    def name(self) -> str: ...

    @property
    def defer_release(self) -> bool: ...


class SchedulerState(Protocol):
    """The scheduler as its view and its plan checks see it (`Scheduler` satisfies it)."""

    @property
    def config(self) -> SchedulerParts: ...

    @property
    def policy(self) -> PolicyTraits: ...

    @property
    def table(self) -> RequestTable: ...

    @property
    def kv(self) -> KVPool: ...

    @property
    def capacity(self) -> KVCapacity: ...

    @property
    def bucket_config(self) -> BucketConfig: ...

    @property
    def engine(self) -> Engine: ...  # whether it speculates, and its step-time estimate

    @property
    def kv_reservation(self) -> str: ...

    @property
    def now_s(self) -> float: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def waiting(self) -> NDArray[np.int64]: ...  # [w]

    @property
    def running(self) -> NDArray[np.int64]: ...  # [r]

    @property
    def unreleased(self) -> NDArray[np.int64]: ...  # [u]

    @property
    def last_finished(self) -> NDArray[np.int64]: ...  # [f]

    @property
    def busy(self) -> NDArray[np.int64]: ...  # [b] requests no step may take now

    def next_arrival_s(self) -> Optional[float]:
        """Arrival time of the next request still to come, or None."""
        ...

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """New pages to run `tokens` of each request now (admissions reserve first)."""
        ...

    @property
    def prefix_caching(self) -> bool: ...

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens an admission of each request now would take from the prefix cache."""
        ...

    def preemption_costs(self, ids: NDArray[np.int64]) -> PreemptionCosts:  # [n]
        """What preempting each request by swap or by recompute would cost now."""
        ...
