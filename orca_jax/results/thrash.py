"""Thrashing: a policy that preempts faster than it finishes, or recomputes more than it
generates.

A policy whose admissions and preemptions chase each other (ranks that move
both ways, and `plan_in_order`'s default `admission_preempts=True`) still makes
progress, so no watchdog stops it: an Andes-style plugin ran 15 minutes and made
228,919 preemptions for 26 tok/s (vllm: 1,668). These figures name it, in
summary.json (`thrash_figures`) and in one warning line a live run logs as soon
as they pass the thresholds (`orca_jax.runner.thrash_watch`).

The thresholds (chosen so that vllm's own preemptions under KV pressure stay
well below them: 1,668 for thousands of finished requests on the Azure
conversation trace):

* more than `MAX_PREEMPTIONS_PER_FINISHED` (1) preemption per finished request,
  or more than `MAX_RECOMPUTED_FRACTION` (half) of the tokens the steps computed
  being recomputed ones (computed before, thrown away by a preemption). A share
  of the work rather than a count per output token: a preempted request
  recomputes its whole prompt, so per output token even vllm's rare preemptions
  weigh near 1 where prompts are long beside their answers;
* judged only once the run has made `MIN_PREEMPTIONS` (100) preemptions, and
  preemptions are counted per finished request over at least `MIN_FINISHED`
  (100) of them, so a burst at the start of a run does not warn.
"""

from __future__ import annotations

from typing import Optional

MAX_PREEMPTIONS_PER_FINISHED = 1.0
MAX_RECOMPUTED_FRACTION = 0.5
MIN_PREEMPTIONS = 100
MIN_FINISHED = 100


def thrash_figures(num_preemptions: int, num_finished: int, recomputed_tokens: int,
                   computed_tokens: int) -> dict[str, Optional[float]]:
    """summary.json's thrash fields.

    Returns:
      `preemptions_per_finished` (None with nothing finished), `recomputed_tokens`
      (computed tokens preemptions threw away, to compute again) and
      `recomputed_token_fraction`: their share of `computed_tokens`, every token the
      steps computed (None with none).
    """
    return {
        "preemptions_per_finished": (num_preemptions / num_finished if num_finished
                                     else None),
        "recomputed_tokens": recomputed_tokens,
        "recomputed_token_fraction": (recomputed_tokens / computed_tokens if computed_tokens
                                      else None),
    }


def thrash_warning(label: str, *, num_preemptions: int, num_finished: int,
                   recomputed_tokens: int, computed_tokens: int, num_steps: int
                   ) -> Optional[str]:
    """The one warning line for a run past a threshold (module docstring), else None.

    Args:
      label: the run's name (its policy's label).
      num_preemptions: preemptions so far.
      num_finished: requests finished so far.
      recomputed_tokens: computed tokens preemptions threw away so far.
      computed_tokens: tokens the steps computed so far (recomputed ones included).
      num_steps: steps run so far (says how early the line came).
    """
    if num_preemptions < MIN_PREEMPTIONS:
        return None
    per_finished = num_preemptions / max(num_finished, MIN_FINISHED)
    fraction = recomputed_tokens / max(computed_tokens, 1)
    if per_finished <= MAX_PREEMPTIONS_PER_FINISHED and fraction <= MAX_RECOMPUTED_FRACTION:
        return None
    return (f"run {label} may be thrashing: {num_preemptions} preemptions for {num_finished} "
            f"finished requests, {recomputed_tokens} of the {computed_tokens} tokens computed "
            f"were recomputed, after {num_steps} steps (thresholds: "
            f"{MAX_PREEMPTIONS_PER_FINISHED:g} preemption per finished request, "
            f"{MAX_RECOMPUTED_FRACTION:.0%} of the tokens recomputed); a "
            f"policy built on plan_in_order whose ranks move both ways wants "
            f"admission_preempts=False (docs/writing_a_policy.md)")
