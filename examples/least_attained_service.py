"""Least attained service: each step runs the requests that have generated the fewest tokens."""

import dataclasses

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, register


@register("las")
@dataclasses.dataclass(kw_only=True)
class LeastAttainedService(Policy):
    """Ranks requests by tokens generated so far (then arrival); the top ones that fit run."""

    max_running: int = 32  # requests that may hold KV pages at once
    kv_reservation: str = "max"  # pages reserved at admission: a paused request never runs dry
    preempts = False  # it pauses, never preempts: so it refuses kv_reservation=none

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        room = max(self.max_running - view.running.size, 0)
        order = np.concatenate([view.running, view.waiting[:room]])
        order = order[np.lexsort((requests.arrival_s[order], requests.num_generated[order]))]
        ids, counts = [], []
        budget, free = view.max_num_tokens, view.kv_room()  # the pages a plan may take
        for request in order.tolist():  # a request that does not fit takes no seat
            left = requests.num_uncomputed([request]) - view.cached_tokens([request])  # past a hit
            count = min(int(left[0]), budget)
            pages = int(view.pages_needed([request], [count])[0])
            if count < 1 or pages > free:
                continue  # paused this step (a running request keeps its pages)
            ids.append(request)
            counts.append(count)
            budget, free = budget - count, free - pages
            if len(ids) == view.max_num_seqs:
                break
        return StepPlan(ids, counts)
