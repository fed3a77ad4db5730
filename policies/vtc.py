"""Virtual Token Counter fair scheduling (Sheng et al., OSDI'24).

Each tenant has a counter of the service it received: `input_weight` per prompt
token and `output_weight` per output token. Running requests always run (VTC
does not preempt for fairness); the free places of the batch go, one at a time,
to the head (oldest) waiting request of the *backlogged* tenant (one with
waiting requests) whose counter is smallest. When a tenant becomes backlogged
its counter is lifted to at least the smallest counter among the other
backlogged tenants, so idling earns no credit to monopolise the server later.

Charging, as in the paper's implementation: a request's whole prompt is charged
when it is first admitted (even if it is prefilled in chunks; a recompute after
a preemption is not charged again, the tenant did not ask for it), and each
output token in the step that samples it. With both tenants backlogged, the
service difference stays bounded (see tests/test_policy_vtc.py for the bound
this implementation obeys). Pages are on demand; when they run out, the running
request of the tenant with the largest counter is preempted by recompute.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register


@register("vtc")
@dataclasses.dataclass(kw_only=True)
class VTC(Policy):
    """Virtual Token Counter.

    Attributes:
      input_weight: counter charge per prompt token (w_in).
      output_weight: counter charge per output token (w_out).
    """

    input_weight: float = 1.0
    output_weight: float = 2.0
    _counter: Optional[NDArray[np.float64]] = dataclasses.field(  # [num_tenants]
        default=None, init=False, repr=False)
    _backlogged: Optional[NDArray[np.bool_]] = dataclasses.field(  # [num_tenants]
        default=None, init=False, repr=False)
    _prompt_charged: Optional[NDArray[np.bool_]] = dataclasses.field(  # [N]
        default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.input_weight >= 0 and self.output_weight >= 0):
            raise ValueError(f"input_weight and output_weight must be >= 0, got "
                             f"{self.input_weight} and {self.output_weight}")

    def counters(self) -> NDArray[np.float64]:
        """`[num_tenants]` a copy of the tenants' counters (index: `requests.tenant`)."""
        return np.zeros(0) if self._counter is None else self._counter.copy()

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        if self._counter is None:
            num_tenants = len(requests.tenant_names)
            self._counter = np.zeros(num_tenants)
            self._backlogged = np.zeros(num_tenants, dtype=bool)
            self._prompt_charged = np.zeros(len(requests), dtype=bool)
        counter, charged = self._counter, self._prompt_charged
        assert charged is not None
        waiting = view.waiting
        self._lift(requests.tenant[waiting])
        running = view.running
        running = running[np.lexsort((running, counter[requests.tenant[running]]))]
        admit = self._admission_order(view, waiting, view.max_num_seqs)
        plan = plan_in_order(view, np.concatenate([running, admit]))
        ids, tokens = plan.request_ids, plan.num_tokens
        first = ids[~charged[ids]]
        np.add.at(counter, requests.tenant[first], self.input_weight * requests.prompt_len[first])
        charged[first] = True
        sampled = ids[tokens == requests.num_uncomputed(ids)]
        np.add.at(counter, requests.tenant[sampled], self.output_weight)
        still_waiting = waiting[~np.isin(waiting, ids)]
        self._backlogged = np.zeros_like(counter, dtype=bool)
        self._backlogged[requests.tenant[still_waiting]] = True
        return plan

    def _lift(self, waiting_tenants: NDArray[np.int64]) -> None:
        """Lifts the counters of tenants that became backlogged since the last step."""
        counter, before = self._counter, self._backlogged
        assert counter is not None and before is not None
        tenants, first = np.unique(waiting_tenants, return_index=True)
        active = [int(t) for t in tenants if before[t]]
        # New tenants in the order their first waiting request arrived, each lifted against
        # the tenants already backlogged, as if they had joined one at a time.
        for t in tenants[np.argsort(first)].tolist():
            if before[t]:
                continue
            if active:
                counter[t] = max(counter[t], counter[active].min())
            active.append(t)

    def _admission_order(self, view: SchedulerView, waiting: NDArray[np.int64],
                         limit: int) -> NDArray[np.int64]:
        """`[<=limit]` waiting requests in VTC's admission order, counters charged as it goes."""
        requests = view.requests
        assert self._counter is not None and self._prompt_charged is not None
        if waiting.size == 0:
            return waiting
        # Each backlogged tenant's queue, in arrival order (`waiting` is): grouped by a
        # stable sort in numpy, so a long queue costs no Python loop over its requests.
        by_tenant = np.argsort(requests.tenant[waiting], kind="stable")
        grouped = waiting[by_tenant]
        tenants = requests.tenant[grouped]
        starts = np.flatnonzero(np.concatenate(([True], tenants[1:] != tenants[:-1])))
        bounds = np.append(starts, grouped.size)
        queues = {int(tenants[s]): grouped[s:e]
                  for s, e in zip(starts.tolist(), bounds[1:].tolist())}
        heap = [(float(self._counter[t]), int(q[0]), t) for t, q in queues.items()]
        heapq.heapify(heap)
        heads = {t: 0 for t in queues}
        order: list[int] = []
        while heap and len(order) < limit:
            count, _, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            request = int(queue[heads[tenant]])
            order.append(request)
            if not self._prompt_charged[request]:
                count += self.input_weight * float(requests.prompt_len[request])
            heads[tenant] += 1
            if heads[tenant] < len(queue):
                heapq.heappush(heap, (count, int(queue[heads[tenant]]), tenant))
        return np.asarray(order, dtype=np.int64)
