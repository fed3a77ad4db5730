"""Speculative decoding's host half: a model-free drafter and the two acceptance rules.

A speculating request's verification step computes its newest token and k draft tokens
after it (k + 1 query rows of one ragged step, as a prefill chunk's rows are); the
target's token at each row says what it would have sampled there. The request keeps

  * `accept_greedy`: the longest prefix of the draft equal to the target's own tokens,
    then the target's token after it, so its output is exactly the one it would have
    had without speculation. The jax engine uses it at every temperature: its row
    tokens are greedy, or drawn with the key that position's token has without
    speculation (`orca_jax.model.llama.sample_rows`); for a deterministic draft
    (prompt lookup) keeping x while the target's draw equals it is the rule below with
    one-hot q, in law (x kept with probability p(x), else a draw from p given not x);
  * sampled (`rejection_sample`): standard speculative rejection sampling (Leviathan et
    al. 2023, Chen et al. 2023), whose output has the target's distribution exactly.

`ngram_draft` is prompt lookup: the tokens that followed the latest earlier occurrence
of the context's last n tokens (no model, no device).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

DRAFTERS = ("ngram", "model")  # --drafter's values: prompt lookup, or a draft model


def ngram_draft(context: NDArray[np.int32],  # [L] the request's prompt and generated tokens
                k: int, *, max_ngram: int = 3, min_ngram: int = 1) -> NDArray[np.int32]:
    """Up to `k` draft tokens by prompt lookup: the longest n-gram (max_ngram down to
    min_ngram) ending the context that occurred earlier, and the tokens after its latest
    earlier occurrence. Empty when none did (the request then verifies nothing extra).

    Args:
      context: every known token of the request, newest last.
      k: the most draft tokens wanted (>= 0).
      max_ngram: the longest suffix looked up.
      min_ngram: the shortest suffix looked up (>= 1).
    """
    length = context.shape[0]
    if k <= 0 or length < 2:
        return np.zeros(0, np.int32)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        # Every start of an n-gram before the suffix's own, latest first.
        windows = np.lib.stride_tricks.sliding_window_view(context[:length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the token after that occurrence
            return context[follow:follow + k].astype(np.int32)
    return np.zeros(0, np.int32)


def accept_greedy(draft: NDArray[np.int32],  # [k] the drafted tokens
                  target: NDArray[np.int32],  # [k + 1] the target's token at each row
                  ) -> NDArray[np.int32]:  # [n + 1] the tokens the request keeps
    """The draft's longest prefix that equals the target's greedy tokens, and the
    target's token after it: `n` accepted drafts plus one token, `1 <= n + 1 <= k + 1`.

    Row i of `target` is the target's token after the newest token and the first i
    drafts, so while the drafts match, each kept token is the one decoding one token
    at a time would have produced next (greedy, or sampled with the same key).
    """
    k = draft.shape[0]
    mismatch = np.flatnonzero(draft != target[:k])
    n = int(mismatch[0]) if mismatch.size else k
    return np.concatenate([draft[:n], target[n:n + 1]]).astype(np.int32)


def rejection_sample(target_probs: NDArray[np.float64],  # [k + 1, V] target's distributions
                     draft_probs: NDArray[np.float64],  # [k, V] the draft's distributions
                     draft: NDArray[np.int32],  # [k] tokens drawn from draft_probs' rows
                     rng: np.random.Generator,
                     ) -> NDArray[np.int32]:  # [n + 1] the tokens the request keeps
    """Speculative rejection sampling: each kept token is distributed exactly as the
    target's, whatever the draft.

    Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the request takes a token from the normalized residual max(0, p_i - q_i)
    and stops; when every draft is accepted it takes a bonus token from p_k. A drafter
    with no distribution (prompt lookup) passes one-hot rows: x_i is then accepted with
    probability p_i(x_i), and the residual is p_i without x_i.

    Args:
      target_probs: row i is the target's distribution after the first i drafts.
      draft_probs: row i is the distribution draft i was drawn from.
      draft: the drafted tokens.
      rng: the source of the acceptance and replacement draws.
    """
    k = draft.shape[0]
    kept: list[int] = []
    for i in range(k):
        token = int(draft[i])
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if q > 0 and rng.random() < min(1.0, p / q):
            kept.append(token)
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        total = residual.sum()
        # Zero residual means p == q exactly, when a rejection cannot happen; p is a safe draw.
        kept.append(_draw(residual / total if total > 0 else target_probs[i], rng))
        return np.asarray(kept, np.int32)
    kept.append(_draw(target_probs[k], rng))
    return np.asarray(kept, np.int32)


def _draw(probs: NDArray[np.float64], rng: np.random.Generator) -> int:  # [V]
    """One token from a distribution (normalized here against rounding)."""
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"),
                   probs.shape[0] - 1))


def one_hot(tokens: NDArray[np.int32], vocab_size: int,  # [k]
            dtype: Optional[type] = np.float64) -> NDArray[np.float64]:  # [k, V]
    """A deterministic drafter's distributions: all mass on the drafted token."""
    out = np.zeros((tokens.shape[0], vocab_size), dtype)
    out[np.arange(tokens.shape[0]), tokens] = 1.0
    return out
