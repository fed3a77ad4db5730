"""A router scorer written outside the project: llm-d's predicted-latency scorer, linear.

Use it in the `chain` router by path:
`--router=chain --router_opts='scorers=examples/predicted_latency_scorer.py:PredictedTTFT'`
(knobs: `stage_opts=predictedttft.prefill_tokens_per_s=20000`).
"""

import dataclasses

import numpy as np

from orca_jax.cluster.routing import RouteScorer
from orca_jax.core.requests.request import RequestState


@dataclasses.dataclass
class PredictedTTFT(RouteScorer):
    """Minus the request's predicted time to first token on each replica: the prompt
    tokens still to compute ahead of it, and its own past the replica's prefix-cache
    hit, at `prefill_tokens_per_s` (llm-d trains its predictor; this one is a line).

    Attributes:
      prefill_tokens_per_s: the prefill rate the prediction assumes.
    """

    prefill_tokens_per_s: float = 10_000.0

    def score(self, view, request, replicas):
        table = view.requests
        ttft = []
        for r in replicas:
            ids = view.outstanding_ids(r)
            ids = ids[table.state[ids] != RequestState.FINISHED]
            ahead = table.num_uncomputed(ids).sum()  # a decoding request adds its one token
            own = table.prompt_len[request] - view.replicas[r].cached_tokens([request])[0]
            ttft.append((ahead + own) / self.prefill_tokens_per_s)
        return -np.array(ttft)
