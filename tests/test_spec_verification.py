"""Speculative decoding's host rules: prompt lookup, greedy acceptance, and rejection
sampling, whose outputs must be distributed exactly as non-speculative sampling's."""

import numpy as np
import pytest

from orca_jax.core.step.verification import (
    accept_greedy,
    ngram_draft,
    one_hot,
    rejection_sample,
)

# chi2.isf(1e-6, df=5): a right distribution fails it once in a million (scipy is no
# dependency of the project; the value is the textbook quantile).
CHI2_5DF_1E6 = 35.888
VOCAB = 6


def test_ngram_draft_follows_the_latest_longest_match():
    context = np.array([1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3], np.int32)
    # "2 3" ends the context; its latest earlier occurrence is at 5, followed by 4 5 7.
    assert ngram_draft(context, 3).tolist() == [4, 5, 7]
    assert ngram_draft(context, 1).tolist() == [4]
    # "9 2 3" (3-gram) occurred once, at 4: the longest suffix wins over the later 2-gram.
    longer = np.array([9, 2, 3, 8, 6, 2, 3, 1, 9, 2, 3], np.int32)
    assert ngram_draft(longer, 2).tolist() == [8, 6]
    # Proposals stop at the context's end; no earlier match proposes nothing.
    assert ngram_draft(np.array([5, 6, 5], np.int32), 4).tolist() == [6, 5]
    assert ngram_draft(np.array([1, 2, 3, 4], np.int32), 4).size == 0
    assert ngram_draft(np.array([1, 2, 1], np.int32), 0).size == 0


@pytest.mark.parametrize("draft,target,kept", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # all accepted, plus the bonus token
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # stops at the first disagreement (6 == 6 later)
    ([4, 5, 6], [8, 5, 6, 7], [8]),  # nothing accepted: the target's own token
    ([-1, -1], [3, 2, 1], [3]),  # no proposal never matches
    ([], [3], [3]),  # k = 0: a plain decode
])
def test_accept_greedy_keeps_the_agreeing_prefix(draft, target, kept):
    assert accept_greedy(np.array(draft, np.int32), np.array(target, np.int32)).tolist() == kept


def _speculative_sequences(target, draft, num_runs, rng, length, k, accept):
    """`num_runs` sequences of `length` tokens, each made by speculative rounds of k drafts
    drawn from `draft[position]` and kept by `accept`; `target[position]` is the target's
    distribution at each position (independent of the context, so the non-speculative
    tokens are independent draws, position by position)."""
    out = np.zeros((num_runs, length), np.int64)
    for run in range(num_runs):
        tokens = []
        while len(tokens) < length:
            pos = len(tokens)
            if draft is None:  # a deterministic drafter: the draft's likeliest token
                drafted = np.array([np.argmax(target[pos + i] + 0.3 * (i % 2))
                                    for i in range(k)], np.int32)
                q = one_hot(drafted, VOCAB)
            else:
                q = draft[pos:pos + k]
                drafted = (rng.random((k, 1)) > np.cumsum(q, axis=1)).sum(axis=1).astype(np.int32)
            tokens.extend(accept(target[pos:pos + k + 1], q, drafted, rng).tolist())
        out[run] = tokens[:length]
    return out


def _chi2(samples, probs):  # [N], [V]
    observed = np.bincount(samples, minlength=probs.shape[0])
    expected = probs * samples.shape[0]
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_rejection_sampling_matches_the_target_distribution(drafter):
    rng = np.random.default_rng(2024)
    length, k = 4, 3
    target = rng.dirichlet(np.ones(VOCAB), size=length + k)  # [positions, V]
    draft = rng.dirichlet(np.ones(VOCAB), size=length + k) if drafter == "model" else None
    tokens = _speculative_sequences(target, draft, 3000, rng, length, k, rejection_sample)
    for pos in range(length):
        assert _chi2(tokens[:, pos], target[pos]) < CHI2_5DF_1E6, pos

    # The test has power: keeping every draft (no rejection) gives the draft's
    # distribution, which the same bound tells apart.
    def keep_all(p, q, drafted, rng):
        return np.concatenate([drafted, [np.argmax(p[-1])]]).astype(np.int32)

    wrong = _speculative_sequences(target, draft, 3000, rng, length, k, keep_all)
    assert max(_chi2(wrong[:, pos], target[pos]) for pos in range(length)) > CHI2_5DF_1E6


def test_rejection_sampling_with_equal_distributions_accepts_everything():
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(VOCAB), size=4)
    drafted = np.array([1, 2, 3], np.int32)
    kept = rejection_sample(p, p[:3], drafted, rng)
    assert kept[:3].tolist() == [1, 2, 3] and kept.size == 4
