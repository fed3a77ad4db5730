"""An example plugin policy: shortest prompt first, loaded as `path/to/file.py:Class`.

Written against the old docs on purpose (the flat `orca_jax.policy` import, the view's
`token_budget`, `max_batch_size` and `watermark_pages`): it checks that such a plugin still
loads and runs.
"""

import dataclasses
import math
from typing import Optional

import numpy as np

from orca_jax import SchedulerView, StepPlan
from orca_jax.policy import Policy, register


@register("example_spf")
@dataclasses.dataclass(kw_only=True)
class ShortestPromptFirst(Policy):
    """Admits the shortest prompts first (longest if asked); `max_wait_s` ends starvation."""

    max_batch_size: Optional[int] = None
    prefill_chunk: int = 512
    max_wait_s: float = math.inf
    longest_first: bool = False
    kv_reservation: str = "max"  # reserved at admission, so running requests never run out

    def schedule(self, view: SchedulerView) -> StepPlan:
        cap = min(self.max_batch_size or view.max_batch_size, view.max_batch_size)
        requests, budget, waiting = view.requests, view.token_budget, view.waiting
        ids, counts = [], []
        prompt = requests.prompt_len[waiting] * (-1 if self.longest_first else 1)
        overdue = view.now_s - requests.arrival_s[waiting] >= self.max_wait_s
        queue = waiting[np.lexsort((waiting, prompt, ~overdue))]
        free = view.num_free_pages - view.watermark_pages
        for request in view.running.tolist() + queue.tolist():
            count = min(int(requests.num_uncomputed([request])[0]), self.prefill_chunk, budget)
            pages = int(view.pages_needed([request], [count])[0])
            if len(ids) >= cap or count < 1 or pages > free:
                break
            ids.append(request)
            counts.append(count)
            budget, free = budget - count, free - pages
        return StepPlan(ids, counts)
