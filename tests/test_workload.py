"""Synthetic workloads: spec parsing, length distributions, arrivals, seeding."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.requests.request import Request, length_only_requests
from orca_jax.workloads.synthetic import (
    EmpiricalLength,
    FixedLength,
    LognormalLength,
    UniformLength,
    ZipfLength,
    arrival_times,
    parse_length_spec,
    synthetic_workload,
    with_prompt_tokens,
)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def _fields(r: Request) -> tuple:
    tokens = None if r.prompt_tokens is None else r.prompt_tokens.tolist()
    return (r.id, r.arrival_s, r.prompt_len, r.output_len, tokens, r.priority, r.tenant,
            r.deadline_s)


def _workload(**overrides) -> list[Request]:
    kwargs = dict(num_requests=200, arrival="poisson", rate=4.0, prompt_len="uniform:8:64",
                  output_len="lognormal:50:0.7", seed=7, vocab_size=1000)
    kwargs.update(overrides)
    return synthetic_workload(**kwargs)


def test_same_seed_is_bit_identical_and_other_seed_differs():
    a, b = _workload(), _workload()
    assert [_fields(r) for r in a] == [_fields(r) for r in b]
    c = _workload(seed=8)
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert not np.array_equal(a[0].prompt_tokens, c[0].prompt_tokens)


def test_workload_is_in_arrival_order_with_ids_0_to_n():
    w = _workload(arrival="gamma", cv=3.0)
    assert [r.id for r in w] == list(range(200))
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(1 <= t < 1000 for r in w for t in r.prompt_tokens)


def test_rate_and_process_change_arrivals_but_not_lengths_or_tokens():
    slow, fast = _workload(rate=2.0), _workload(rate=8.0)
    burst = _workload(arrival="burst", rate=None)
    for other in (fast, burst):
        assert [r.prompt_len for r in other] == [r.prompt_len for r in slow]
        assert [r.output_len for r in other] == [r.output_len for r in slow]
        assert all(np.array_equal(x.prompt_tokens, y.prompt_tokens) for x, y in zip(other, slow))
    # Standardized gaps: four times the rate is the same arrivals at a quarter of the times.
    np.testing.assert_allclose([r.arrival_s for r in fast], [r.arrival_s / 4 for r in slow])
    assert all(r.arrival_s == 0.0 for r in burst)


def test_poisson_gaps_have_mean_one_over_rate():
    t = arrival_times("poisson", 20_000, np.random.default_rng(0), rate=4.0)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.25) < 0.25 * 0.03
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.04  # exponential: cv 1


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_gaps_have_requested_mean_and_cv(cv):
    gaps = np.diff(arrival_times("gamma", 20_001, np.random.default_rng(1), rate=10.0, cv=cv))
    assert abs(gaps.mean() - 0.1) < 0.1 * 0.05
    assert abs(gaps.std() / gaps.mean() - cv) < cv * 0.08


@pytest.mark.parametrize("kwargs, message", [
    (dict(arrival="poisson", rate=None), "rate must be"),
    (dict(arrival="gamma", rate=0.0), "rate must be"),
    (dict(arrival="poisson", rate=-1.0), "rate must be"),
    (dict(arrival="gamma", rate=1.0, cv=0.0), "cv must be"),
    (dict(arrival="uniform", rate=1.0), "arrival process 'uniform'"),
    (dict(num_requests=0), "num_requests must be"),
    (dict(seed=-1), "seed must be"),
    (dict(vocab_size=1), "vocab_size must be"),
    (dict(max_total_len=1), "max_total_len must be"),
    (dict(prompt_len="uniform:9:3"), "'uniform:9:3'"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _workload(**kwargs)


def test_max_total_len_clips_each_request_to_fit():
    w = _workload(prompt_len="uniform:50:200", output_len="uniform:50:200", max_total_len=128)
    assert all(r.total_len <= 128 and r.output_len >= 1 for r in w)
    assert max(r.prompt_len for r in w) == 127  # prompts over 127 are cut to leave one output
    unclipped = _workload(prompt_len="uniform:50:200", output_len="uniform:50:200")
    assert [r.prompt_len for r in w] == [min(r.prompt_len, 127) for r in unclipped]


@pytest.mark.parametrize("spec, expected", [
    ("fixed:32", FixedLength(32)),
    ("uniform:1:10", UniformLength(1, 10)),
    ("lognormal:1000:0.8", LognormalLength(1000.0, 0.8)),
    ("zipf:1.5:4096", ZipfLength(1.5, 4096)),
])
def test_parse_length_spec_and_spec_round_trip(spec, expected):
    dist = parse_length_spec(spec)
    assert dist == expected
    assert parse_length_spec(dist.spec) == dist


@pytest.mark.parametrize("spec, message", [
    ("fixed:0", "N >= 1"),
    ("fixed:ten", "fixed:N"),
    ("uniform:5", "uniform:LO:HI"),
    ("uniform:0:5", "1 <= LO <= HI"),
    ("lognormal:abc:1", "lognormal:MEAN:SIGMA"),
    ("lognormal:100:-1", "SIGMA >= 0"),
    ("zipf:1.0:100", "A > 1"),
    ("zipf:2:0", "MAX"),
    ("gauss:1:2", "fixed:N, uniform:LO:HI"),
    ("empirical:", "empirical:PATH"),
    ("empirical:/no/such/file.csv:col", "no such file"),
])
def test_bad_specs_name_the_spec_and_the_expected_form(spec, message):
    with pytest.raises(ValueError) as info:
        parse_length_spec(spec)
    assert repr(spec) in str(info.value) and message in str(info.value)


@settings(max_examples=40, deadline=None)
@given(low=st.integers(1, 50), width=st.integers(0, 5), seed=st.integers(0, 2**32))
def test_uniform_includes_both_ends(low, width, seed):
    values = UniformLength(low, low + width).sample(np.random.default_rng(seed), 400)
    assert set(values.tolist()) == set(range(low, low + width + 1))


def test_lognormal_mean_is_the_length_mean():
    values = LognormalLength(500.0, 0.5).sample(np.random.default_rng(2), 20_000)
    assert values.dtype == np.int64 and values.min() >= 1
    assert abs(values.mean() - 500) < 500 * 0.02
    # The median of a lognormal is exp(mu) = mean * exp(-sigma^2 / 2), below the mean.
    assert abs(np.median(values) - 500 * np.exp(-0.125)) < 500 * 0.03


def test_lognormal_with_tiny_mean_never_gives_zero():
    assert LognormalLength(1.0, 1.5).sample(np.random.default_rng(0), 5_000).min() == 1


def test_zipf_stays_in_bounds_and_follows_the_power_law():
    values = ZipfLength(2.0, 100).sample(np.random.default_rng(3), 20_000)
    assert values.min() == 1 and values.max() <= 100
    p = 1.0 / np.arange(1, 101) ** 2
    p /= p.sum()
    assert abs((values == 1).mean() - p[0]) < 0.015
    assert abs((values == 2).mean() - p[1]) < 0.015
    assert set(ZipfLength(1.1, 3).sample(np.random.default_rng(0), 500).tolist()) == {1, 2, 3}


def test_empirical_uses_callers_default_column_and_vidur_names(tmp_path):
    f = tmp_path / "lengths.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n100,3\n200,4\n")
    w = synthetic_workload(num_requests=300, arrival="burst", rate=None,
                           prompt_len=f"empirical:{f}", output_len=f"empirical:{f}", seed=0)
    assert {r.prompt_len for r in w} == {100, 200}
    assert {r.output_len for r in w} == {3, 4}
    explicit = parse_length_spec(f"empirical:{f}:num_decode_tokens")
    assert isinstance(explicit, EmpiricalLength) and explicit.values.tolist() == [3, 4]
    with pytest.raises(ValueError, match="no default column"):
        parse_length_spec(f"empirical:{f}")


def test_empirical_bad_column_names_spec_file_and_column(tmp_path):
    f = tmp_path / "lengths.csv"
    f.write_text("a,b\n1,2\n3,x\n")
    with pytest.raises(ValueError, match=r"'empirical:.*lengths.csv:c'.*lengths.csv:1: field 'c'"):
        parse_length_spec(f"empirical:{f}:c")
    with pytest.raises(ValueError, match=r"lengths.csv:3: field 'b'"):
        parse_length_spec(f"empirical:{f}:b")


def test_empirical_on_the_real_arxiv_lengths():
    path = TRACES / "arxiv_summarization_lengths.csv"
    if not path.is_file():
        pytest.skip(f"shared traces are absent ({TRACES}); they live beside the repository")
    dist = parse_length_spec(f"empirical:{path}", default_column="prompt_len")
    assert len(dist.values) == 28_257
    sample = dist.sample(np.random.default_rng(0), 20_000)
    assert abs(sample.mean() - dist.values.mean()) < 0.05 * dist.values.mean()


def test_with_prompt_tokens_depends_only_on_seed_and_id():
    w = _workload(vocab_size=None, num_requests=20)
    assert all(r.prompt_tokens is None for r in w)
    full = with_prompt_tokens(w, vocab_size=50, seed=3)
    subset = with_prompt_tokens(w[10:][::-1], vocab_size=50, seed=3)
    assert all(r.prompt_tokens.shape == (r.prompt_len,) for r in full)
    assert all(1 <= t < 50 for r in full for t in r.prompt_tokens)
    for r in subset:
        assert np.array_equal(r.prompt_tokens, full[r.id].prompt_tokens)
    other_seed = with_prompt_tokens(w, vocab_size=50, seed=4)
    assert not np.array_equal(other_seed[0].prompt_tokens, full[0].prompt_tokens)
    assert not np.array_equal(full[1].prompt_tokens[:5], full[2].prompt_tokens[:5])
    assert with_prompt_tokens(full, vocab_size=50, seed=9)[0] is full[0]  # ids kept


def test_a_prompt_beyond_the_context_gets_ids_that_take_no_memory():
    # 2e9 drawn ids would allocate 7.45 GiB before the scheduler rejects the request.
    long = synthetic_workload(num_requests=2, arrival="burst", rate=None,
                              prompt_len="fixed:2000000000", output_len="fixed:4", seed=0,
                              vocab_size=512, context=1024)
    assert [r.prompt_tokens.shape for r in long] == [(2_000_000_000,)] * 2
    assert all(r.prompt_tokens.strides == (0,) for r in long)  # one id, broadcast
    fits = synthetic_workload(num_requests=2, arrival="burst", rate=None, prompt_len="fixed:8",
                              output_len="fixed:4", seed=0, vocab_size=512, context=12)
    assert all(r.prompt_tokens.strides == (4,) and len(set(r.prompt_tokens)) > 1 for r in fits)
    traced = with_prompt_tokens(
        [Request(id=0, arrival_s=0.0, prompt_len=2_000_000_000, output_len=1),
         Request(id=1, arrival_s=0.0, prompt_len=8, output_len=4)], 512, seed=0, context=12)
    assert traced[0].prompt_tokens.strides == (0,) and traced[1].prompt_tokens.strides == (4,)


def _every_field(r: Request) -> tuple:
    return tuple((name, getattr(r, name)) for name in Request.__dataclass_fields__)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1e6), st.integers(1, 10**6), st.integers(1, 10**6)),
                min_size=0, max_size=20))
def test_length_only_requests_are_the_requests_made_one_by_one(rows):
    # The simulator's workload makes its requests whole, past Request's __init__: each
    # field, of the same type, must be what the constructor would have set.
    arrival = np.array([r[0] for r in rows], dtype=np.float64)
    prompt = np.array([r[1] for r in rows], dtype=np.int64)
    output = np.array([r[2] for r in rows], dtype=np.int64)
    made = length_only_requests(arrival, prompt, output)
    expected = [Request(id=i, arrival_s=a, prompt_len=p, output_len=o)
                for i, (a, p, o) in enumerate(rows)]
    assert [_every_field(r) for r in made] == [_every_field(r) for r in expected]
    assert [tuple(type(v) for _, v in _every_field(r)) for r in made] == [
        tuple(type(v) for _, v in _every_field(r)) for r in expected]


@pytest.mark.parametrize("arrival, prompt, output, message", [
    ([0.0, -1.0], [5, 5], [5, 5], "request 1: arrival_s must be a finite number >= 0"),
    ([0.0, np.inf], [5, 5], [5, 5], "request 1: arrival_s must be a finite number >= 0"),
    ([0.0, 1.0], [5, 0], [5, 5], "request 1: prompt_len must be an integer >= 1"),
    ([0.0, 1.0], [5, 5], [0, 5], "request 0: output_len must be an integer >= 1"),
])
def test_length_only_requests_refuse_what_request_refuses(arrival, prompt, output, message):
    with pytest.raises(ValueError, match=message):
        length_only_requests(np.array(arrival, dtype=np.float64), np.array(prompt),
                             np.array(output))
