"""Learning to rank (Fu et al., NeurIPS'24): SJF or SRPT ordered by a trained ranker's score.

The ranker (`orca_jax.learned.ranker`, trained by `python -m experiments.train_ranker`)
scores each request's prompt once, when the request is first seen, and its
score is mapped to output-token units by a monotone calibration fitted on its
training set; `sjf` (`preemptive=false`) or `srpt` (`preemptive=true`) then
rank by those numbers exactly as they rank by any other predictor. The
starvation guard is theirs: a request left waiting (sjf) or unscheduled (srpt)
for `starvation_s` seconds is promoted, as the paper's starvation counter does.

`prompt_token_weight` defaults to 0: the paper ranks by generation length
alone; raise it to count prefill work as well.
"""

from __future__ import annotations

import dataclasses
import math

from orca_jax import Policy, SchedulerView, StepPlan, register
from orca_jax.learned.length_predictor import register_ltr_predictor
from policies.sjf import SJF
from policies.srpt import SRPT


@register("ltr")
@dataclasses.dataclass(kw_only=True)
class LTR(Policy):
    """SJF/SRPT by a learned ranking of output lengths.

    Attributes:
      ranker_dir: directory of a ranker saved by `Ranker.save` (required).
      preemptive: re-rank every step and pause the rest (srpt) instead of
        ranking only admissions (sjf).
      prompt_token_weight: work of one prompt token relative to one output token.
      starvation_s: a request waiting (or, preemptive, unscheduled) this long
        is promoted (inf: never).
    """

    ranker_dir: str = ""
    preemptive: bool = False
    prompt_token_weight: float = 0.0
    starvation_s: float = math.inf
    _ordering: Policy = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ranker_dir:
            raise ValueError("policy 'ltr' needs a trained ranker: set the option ranker_dir "
                             "(--policy_opts ranker_dir=DIR; train one with python -m "
                             "experiments.train_ranker --out_dir=DIR)")
        # The predictor registry imports the ranker (and jax) only when it restores it, below,
        # so `import policies` stays free of jax.
        name = register_ltr_predictor(self.ranker_dir)
        ordering = SRPT if self.preemptive else SJF
        try:  # the ordering's PredictionCache restores the ranker now, once
            self._ordering = ordering(predictor=name, prompt_token_weight=self.prompt_token_weight,
                                      starvation_s=self.starvation_s)
        except FileNotFoundError as e:
            raise ValueError(f"policy 'ltr' option ranker_dir={self.ranker_dir!r}: {e}") from e

    def schedule(self, view: SchedulerView) -> StepPlan:
        return self._ordering.schedule(view)
