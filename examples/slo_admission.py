"""SLO-aware admission: FCFS that rejects a waiting request once its TTFT SLO is out of reach.

Each step, every request still waiting for its first token is given an estimate
of its first token's time: the prompt tokens queued ahead of it and its own,
computed at the step's budget (less a token per running decode), at the step
time the policy has measured on the clock. A request whose wait so far plus
that estimate exceeds the run's TTFT SLO (`--ttft_slo_s`, read from the view) is
rejected with a reason rather than served late: the pages and steps it would
take go to requests that can still make it. Without an SLO it is plain FCFS.
"""

import dataclasses
import math

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register


@register("slo_admission")
@dataclasses.dataclass(kw_only=True)
class SLOAdmission(Policy):
    """FCFS (vLLM-like, pages on demand) with TTFT-SLO admission control.

    Attributes:
      slack: reject when the estimated TTFT exceeds `slack * ttft_slo_s` (above 1
        admits more, trusting the estimate less).
    """

    slack: float = 1.0
    _step_s: float = dataclasses.field(default=math.nan, init=False)  # measured step time
    _last: tuple = dataclasses.field(default=(math.nan, False), init=False)  # (now, ran)

    def schedule(self, view: SchedulerView) -> StepPlan:
        last_now, ran = self._last
        if ran:  # the clock moved by one step since the previous call
            step = view.now_s - last_now
            self._step_s = step if math.isnan(self._step_s) else 0.8 * self._step_s + 0.2 * step
        reject = self._unreachable(view)
        waiting = view.waiting[~np.isin(view.waiting, list(reject))]
        plan = plan_in_order(view, np.concatenate([view.running, waiting]))
        self._last = (view.now_s, plan.request_ids.size > 0)
        return StepPlan(plan.request_ids, plan.num_tokens, preempt=plan.preempt, reject=reject)

    def _unreachable(self, view: SchedulerView) -> dict[int, str]:
        """`{request: reason}` of the waiting requests that cannot meet the TTFT SLO."""
        slo, requests = view.ttft_slo_s, view.requests
        if slo is None or math.isnan(self._step_s):
            return {}
        per_step = max(view.max_num_tokens - view.running.size, 1)  # prefill tokens a step
        reject, queued = {}, 0
        for request in view.waiting[np.isnan(requests.first_token_s[view.waiting])].tolist():
            queued += int(requests.num_uncomputed([request])[0])
            needs = math.ceil(queued / per_step) * self._step_s
            waited = view.now_s - float(requests.arrival_s[request])
            if waited + needs > self.slack * slo:
                reject[request] = (f"TTFT SLO {slo:g} s unreachable: waited {waited:.3f} s, "
                                   f"its prefill needs ~{needs:.3f} s more")
                queued -= int(requests.num_uncomputed([request])[0])  # it leaves the queue
        return reject
