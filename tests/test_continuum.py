"""The `continuum` policy: it pins a finished call's KV for its TTL when the tool pause after
it is short, and frees it when the pause is long; otherwise it schedules as `vllm`."""

import dataclasses

import numpy as np
import pytest
from test_programs import CONFIG, small_programs
from test_scheduler_invariants import make_builtin, run_checked, sim_engine

from orca_jax import Scheduler, make_policy
from policies.continuum import Continuum


@dataclasses.dataclass(kw_only=True)
class RecordingContinuum(Continuum):
    """continuum that records every call it was asked about and the seconds it answered."""

    asked: list = dataclasses.field(default_factory=list)

    def kv_pin_s(self, view, finished):
        seconds = super().kv_pin_s(view, finished)
        self.asked += list(zip(np.asarray(finished).tolist(), np.asarray(seconds).tolist()))
        return seconds


def _next_pause(requests) -> dict[int, float]:
    """Row -> the shortest tool pause of the calls that name it a parent (from the specs)."""
    row = {(r.program_id, r.call_index): i for i, r in enumerate(requests)}
    pause: dict[int, float] = {}
    for r in requests:
        for parent in r.parents:
            p = row[r.program_id, parent]
            pause[p] = min(pause.get(p, np.inf), r.tool_s)
    return pause


@pytest.mark.parametrize("shape", ["copilot", "parallel"])
def test_continuum_pins_a_call_before_a_short_pause_and_not_before_a_long_one(shape):
    requests = small_programs(shape, 60)
    ttl = 0.2
    policy = RecordingContinuum(pin_ttl_s=ttl)
    scheduler = Scheduler(requests, policy, sim_engine(), CONFIG)
    run_checked(scheduler)
    pause = _next_pause(requests)
    asked = dict(policy.asked)
    assert set(asked) == set(pause)  # every call with a child, once it finished, and no other
    for row, seconds in asked.items():
        assert seconds == (ttl if pause[row] <= ttl else 0.0), (row, pause[row])
    pinned = sum(s > 0 for s in asked.values())
    assert 0 < pinned < len(asked)  # both kinds of pause occur
    book = scheduler.table.programs
    assert book.num_pins == pinned and book.num_pin_hits > 0 and not book.pins
    assert (scheduler.table.num_generated == scheduler.table.output_len).all()


def test_continuum_without_programs_decides_as_vllm():
    from test_gateway_routers import _workload
    runs = []
    for policy in (make_builtin("vllm"), make_policy("continuum")):
        scheduler = Scheduler(_workload(n=40), policy, sim_engine(), CONFIG)
        run_checked(scheduler)
        runs.append(scheduler.table.finish_s.copy())
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_ttl_is_refused(ttl):
    with pytest.raises(ValueError, match="continuum: pin_ttl_s must be a finite number > 0"):
        Continuum(pin_ttl_s=ttl)


def test_continuum_on_two_replicas_finishes_every_call_in_dependency_order():
    from test_programs import _check_program_order

    from orca_jax import RequestState
    from orca_jax.cluster.replicas import Cluster
    cluster = Cluster(small_programs("parallel", 40), num_replicas=2, router="program_affinity",
                      make_policy=lambda: Continuum(pin_ttl_s=0.2), make_engine=sim_engine,
                      config=CONFIG)
    result = cluster.run()
    assert (result.state == RequestState.FINISHED).all()
    _check_program_order(cluster.replicas[0].table)
