"""KV pinned across a program's tool pauses (docs/programs.md): a pinned call's pages stay
held (counted against the pool) until a child is admitted over them as a prefix hit, its
time runs out, or an iteration would otherwise stall; the policy decides per call; and on
the real `tiny` engine, pinning changes no greedy token."""

import numpy as np
import pytest
from test_programs import _check_program_order, small_programs
from test_scheduler_invariants import sim_engine

import policies
from orca_jax import KVConfig, Request, RequestState, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from policies.vllm import VLLM


def _config(num_kv_pages: int, kv_pin_s: float, page_size: int = 16) -> SchedulerConfig:
    return SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=256,
                                             max_model_len=1024),
                           kv=KVConfig(num_kv_pages=num_kv_pages, page_size=page_size,
                                       kv_pin_s=kv_pin_s))


def _run(kv_pin_s, num_kv_pages=200, policy=None):
    scheduler = Scheduler(small_programs("copilot", 50), policy or policies.make_policy("vllm"),
                          sim_engine(), _config(num_kv_pages, kv_pin_s))
    pinned_seen = 0
    while scheduler.step():
        table = scheduler.table
        held = scheduler.kv.num_held
        finished_holding = (table.state == RequestState.FINISHED) & (held > 0)
        pinned_seen = max(pinned_seen, int(held[finished_holding].sum()))
        # A pinned page counts against the pool: free + held (each page once) is the pool.
        scheduler.kv.check_consistency()
        assert set(np.flatnonzero(finished_holding).tolist()) == set(table.programs.pins)
    return scheduler, pinned_seen


def test_a_pinned_call_keeps_its_pages_until_its_child_takes_them_as_a_hit():
    free_run, free_pinned = _run(0.0)
    pin_run, pin_pinned = _run(np.inf)
    _check_program_order(free_run.table)
    _check_program_order(pin_run.table)
    assert free_pinned == 0 and free_run.table.programs.num_pins == 0
    book = pin_run.table.programs
    assert pin_pinned > 0 and book.num_pins > 10
    assert book.num_pin_hits == book.num_pins  # roomy: every pin ends in its child's hit
    assert not book.pins and book.pinned_page_s > 0


@pytest.mark.parametrize("num_kv_pages", [40, 60])
def test_in_a_small_pool_pins_keep_history_that_tool_pauses_would_lose(num_kv_pages):
    free_run, _ = _run(0.0, num_kv_pages=num_kv_pages)
    pin_run, _ = _run(np.inf, num_kv_pages=num_kv_pages)
    _check_program_order(pin_run.table)
    # Unpinned, the history is evicted during the tool pauses; pinned, more of it hits
    # (some pins end early, when an iteration would otherwise stall on them).
    book = pin_run.table.programs
    assert 0 < book.num_pin_hits < book.num_pins
    assert (int(pin_run.table.num_cached_tokens.sum())
            > int(free_run.table.num_cached_tokens.sum()))


def test_a_pin_ends_when_its_time_runs_out():
    scheduler, _ = _run(1e-3)
    book = scheduler.table.programs
    assert book.num_pins > 10 and not book.pins
    # Tool pauses last 1-400 ms: most pins end before their child arrives.
    assert book.num_pin_hits < book.num_pins / 2


def test_pins_never_stall_a_tight_pool():
    scheduler, pinned = _run(np.inf, num_kv_pages=40)
    _check_program_order(scheduler.table)
    assert pinned > 0


class NoPins(VLLM):
    """vllm that pins nothing, whatever the run says (the hook a plugin overrides)."""

    def kv_pin_s(self, view, finished):
        return np.zeros(finished.size)


def test_the_policy_decides_each_pin():
    scheduler, pinned = _run(np.inf, policy=NoPins())
    assert pinned == 0 and scheduler.table.programs.num_pins == 0


def test_a_cluster_refuses_pins_in_one_line():
    with pytest.raises(ValueError, match="^kv_pin_s: pinning a program's KV across tool "
                                         "pauses is for one replica for now"):
        Cluster(small_programs("copilot", 20), num_replicas=2, router="round_robin",
                make_policy=lambda: policies.make_policy("vllm"), make_engine=sim_engine,
                config=_config(200, 5.0))


@pytest.mark.slow
@pytest.mark.usefixtures("session_compile_cache")  # the second engine loads the first's steps
def test_pinning_changes_no_greedy_token_on_the_tiny_engine():
    from orca_jax.model.engine import JaxEngine
    from orca_jax.model.weights import init_params
    from orca_jax.specs.model_config import get_model_config

    config = get_model_config("tiny")
    rng = np.random.default_rng(3)

    def ids(n):
        return rng.integers(1, config.vocab_size, size=n).astype(np.int32)

    first, answer = ids(24), ids(6)
    requests = [Request(id=0, arrival_s=0.0, prompt_len=24, output_len=6, prompt_tokens=first,
                        planned_output_tokens=answer, program_id=0, call_index=0)]
    child = np.concatenate([first, answer, ids(4)])
    requests.append(Request(id=1, arrival_s=2.0, prompt_len=child.size, output_len=5,
                            prompt_tokens=child, program_id=0, call_index=1, parents=(0,),
                            tool_s=2.0))
    for i in range(3):  # traffic during the tool pause, enough to evict unpinned pages
        requests.append(Request(id=2 + i, arrival_s=0.5, prompt_len=40, output_len=8,
                                prompt_tokens=ids(40)))

    def run(kv_pin_s):
        engine = JaxEngine(config, init_params(config, seed=1), num_cache_pages=33,
                           page_size=4, pages_per_seq=16, attention="reference")
        scheduler = Scheduler(requests, policies.make_policy("vllm"), engine,
                              SchedulerConfig(limits=StepLimits(max_num_seqs=4,
                                                                max_num_tokens=32,
                                                                max_model_len=64,
                                                                token_buckets=(8, 32)),
                                              kv=KVConfig(num_kv_pages=32, page_size=4,
                                                          kv_pin_s=kv_pin_s)))
        result = scheduler.run()
        return [t.tolist() for t in result.output_tokens], scheduler

    free_tokens, free = run(0.0)
    pinned_tokens, pinned = run(np.inf)
    assert pinned.table.programs.num_pin_hits == 1
    row = [i for i, s in enumerate(pinned.table.specs) if s.id == 1][0]
    assert pinned.table.num_cached_tokens[row] >= 24 > free.table.num_cached_tokens[row]
    assert pinned_tokens == free_tokens
