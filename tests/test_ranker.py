"""The learned ranker: Kendall's tau, losses, held-out ranking quality, orbax round trip."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import Request
from orca_jax.learned.length_predictor import get_predictor, register_ltr_predictor
from orca_jax.learned.ranker import (
    Ranker,
    RankerConfig,
    kendall_tau,
    listmle_loss,
    ranknet_loss,
    request_features,
    synthetic_ranking_workload,
    train_ranker,
)

NUM_TRAIN = 800
CONFIG = RankerConfig(num_steps=150)


@pytest.fixture(scope="module")
def split():
    requests = synthetic_ranking_workload(NUM_TRAIN + 200, seed=0)
    return requests[:NUM_TRAIN], requests[NUM_TRAIN:]


@pytest.fixture(scope="module")
def ranker(split):
    return train_ranker(split[0], CONFIG)


def lengths(requests):
    return np.array([r.output_len for r in requests])


def test_kendall_tau_by_hand():
    # 6 pairs, one discordant (2, 3): (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(2 / 3)
    assert kendall_tau([4, 3, 2, 1], [1, 2, 3, 4]) == pytest.approx(-1.0)
    # tau-b with a tie in x: pairs (0,2), (1,2) concordant, (0,1) tied in x only.
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(2 * 3))
    assert kendall_tau([5, 5, 5], [1, 2, 3]) == 0.0
    # Blocks of 512 rows must add up: a long reversed pair of orders.
    assert kendall_tau(np.arange(1100), -np.arange(1100)) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="kendall_tau"):
        kendall_tau([1, 2], [1, 2, 3])


def test_kendall_tau_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, 700), rng.integers(0, 30, 700)
    y = y + x  # correlated, with many ties on both sides
    assert kendall_tau(x, y) == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)


def test_listmle_and_ranknet_losses_by_hand():
    # Two items, longest first: -log P(order) = log(e^a + e^b) - a.
    a, b = 0.3, 1.2
    assert float(listmle_loss(jnp.array([[a, b]]))) == pytest.approx(
        math.log(math.exp(a) + math.exp(b)) - a, rel=1e-6)
    # Three items: sum over positions of logsumexp(tail) - score.
    s = [2.0, -1.0, 0.5]
    want = (math.log(sum(math.exp(v) for v in s)) - s[0]
            + math.log(math.exp(s[1]) + math.exp(s[2])) - s[1])
    assert float(listmle_loss(jnp.array([s]))) == pytest.approx(want, rel=1e-6)
    # RankNet averages softplus(-(s_longer - s_shorter)) over pairs of different length.
    got = ranknet_loss(jnp.array([[a, b, 0.0]]), jnp.array([[5.0, 3.0, 3.0]]))
    want = (math.log1p(math.exp(-(a - b))) + math.log1p(math.exp(-(a - 0.0)))) / 2
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_features_of_requests_with_and_without_tokens():
    config = RankerConfig(num_token_buckets=64, num_tenant_buckets=4)
    tokens = np.array([7, 7, 9, 100], dtype=np.int32)
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=1, prompt_tokens=tokens,
                        tenant="a", priority=2),
                Request(id=1, arrival_s=0.0, prompt_len=9, output_len=1, tenant="a")]
    bag, dense = request_features(requests, config)
    assert bag.shape == (2, 64) and dense.shape == (2, config.num_dense)
    np.testing.assert_allclose(bag[0].sum(), 1.0)  # fractions of the prompt
    assert bag[0].max() >= 0.5  # token 7 twice lands in one bucket
    assert (bag[1] == 0).all() and dense[1, 1] == 0 and dense[0, 1] == 1
    np.testing.assert_allclose(dense[:, 0], np.log1p([4, 9]), rtol=1e-6)
    assert dense[0, 2] == 2 and dense[1, 2] == 0
    np.testing.assert_array_equal(dense[0, 3:], dense[1, 3:])  # same tenant, same bucket
    assert dense[0, 3:].sum() == 1


def test_held_out_ranking_beats_random_clearly(ranker, split):
    held_out = split[1]
    truth = lengths(held_out)
    tau = kendall_tau(ranker.scores(held_out), truth)
    assert tau > 0.6, tau  # measured 0.69 (random ranking: ~0 +- 0.05 on 200 requests)
    predicted = ranker.predict_output_len(held_out)
    assert kendall_tau(predicted, truth) > 0.6
    # The calibration keeps the score's order and speaks in training lengths.
    by_score = predicted[np.argsort(ranker.scores(held_out))]
    assert (np.diff(by_score) >= 0).all()
    train_lengths = lengths(split[0])
    assert by_score[0] >= train_lengths.min() and by_score[-1] <= train_lengths.max()
    assert by_score[-1] > 4 * by_score[0]


def test_shuffled_labels_learn_nothing(split):
    train, held_out = split
    rng = np.random.default_rng(1)
    shuffled = [Request(id=r.id, arrival_s=0.0, prompt_len=r.prompt_len, output_len=int(o),
                        prompt_tokens=r.prompt_tokens)
                for r, o in zip(train, rng.permutation(lengths(train)))]
    tau = kendall_tau(train_ranker(shuffled, CONFIG).scores(held_out), lengths(held_out))
    assert abs(tau) < 0.2, tau


def test_pairwise_loss_learns_too(split):
    train, held_out = split
    ranker = train_ranker(train, RankerConfig(loss="ranknet", num_steps=150))
    assert kendall_tau(ranker.scores(held_out), lengths(held_out)) > 0.6


def test_training_is_deterministic(split):
    config = RankerConfig(num_steps=5, seed=3)
    first, second = train_ranker(split[0][:100], config), train_ranker(split[0][:100], config)
    assert first.params.keys() == second.params.keys()
    for name in first.params:
        np.testing.assert_array_equal(first.params[name], second.params[name])
    other = train_ranker(split[0][:100], RankerConfig(num_steps=5, seed=4))
    assert not np.array_equal(first.params["w1"], other.params["w1"])


def test_orbax_round_trip_and_predictor_registry(ranker, split, tmp_path):
    held_out = split[1]
    directory = tmp_path / "ranker"
    ranker.save(str(directory))
    restored = Ranker.restore(str(directory))
    assert restored.config == ranker.config
    np.testing.assert_array_equal(restored.scores(held_out), ranker.scores(held_out))
    np.testing.assert_array_equal(restored.predict_output_len(held_out),
                                  ranker.predict_output_len(held_out))
    with pytest.raises(FileExistsError, match="already holds a saved ranker"):
        ranker.save(str(directory))
    name = register_ltr_predictor(str(directory))
    assert name == f"ltr:{directory}"
    assert register_ltr_predictor(str(directory)) == name  # registering again is harmless
    np.testing.assert_array_equal(get_predictor(name).predict_output_len(held_out),
                                  ranker.predict_output_len(held_out))
    with pytest.raises(FileNotFoundError, match="ranker.json is missing"):
        Ranker.restore(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("kwargs, word", [({"loss": "hinge"}, "loss"),
                                          ({"list_size": 1}, "list_size"),
                                          ({"embed_dim": 0}, "embed_dim"),
                                          ({"learning_rate": 0.0}, "learning_rate")])
def test_bad_config_names_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        RankerConfig(**kwargs)


def test_training_needs_an_order_to_learn():
    same = [Request(id=i, arrival_s=0.0, prompt_len=3, output_len=5) for i in range(4)]
    with pytest.raises(ValueError, match="different output lengths"):
        train_ranker(same)


def test_synthetic_workload_lengths_follow_the_task():
    requests = synthetic_ranking_workload(400, seed=5, num_tasks=4, noise_sigma=0.0,
                                          vocab_size=4096)
    assert [r.id for r in requests] == list(range(400))
    assert all(r.arrival_s == 0.0 and len(r.prompt_tokens) == r.prompt_len for r in requests)
    # Without noise, prompts drawing task tokens from the highest range are the longest
    # outputs at equal prompt length: the task is readable from the tokens.
    filler = 4096 - 4 * 256  # task k owns ids [filler + 256 k, filler + 256 (k + 1))
    with_task = [r for r in requests if r.prompt_tokens.max() >= filler]
    assert len(with_task) > 380  # a 16-token prompt has no task token with p = 0.75**16
    task_of = [(int(r.prompt_tokens.max()) - filler) // 256 for r in with_task]
    by_task = {t: [r.output_len / (r.prompt_len / 128) ** 0.3
                   for r, k in zip(with_task, task_of) if k == t] for t in set(task_of)}
    assert sorted(by_task) == [0, 1, 2, 3]
    assert (np.diff([np.mean(by_task[t]) for t in range(4)]) > 0).all()
    spaced = synthetic_ranking_workload(50, seed=5, arrival_rate=10.0)
    arrivals = [r.arrival_s for r in spaced]
    assert arrivals[0] == 0.0 and (np.diff(arrivals) > 0).all()
