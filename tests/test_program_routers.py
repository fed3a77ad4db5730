"""The program-affinity router: a program's calls stay on its replica below the load bound and
move to the least loaded above it, read back through a recording subclass."""

import dataclasses

import numpy as np
import pytest
from test_programs import CONFIG, small_programs
from test_scheduler_invariants import make_builtin, sim_engine

from orca_jax import RequestState
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView
from policies.program_routers import ProgramAffinity


@dataclasses.dataclass
class RecordingAffinity(ProgramAffinity):
    """program_affinity that records, per decision: the program, the replica of its previous
    call (-1: none), the loads and the choice."""

    seen: list = dataclasses.field(default_factory=list)
    last: dict = dataclasses.field(default_factory=dict)

    def route(self, view: ClusterView, request: int) -> int:
        load = view.outstanding().copy()
        program = view.requests.spec(request).program_id
        choice = super().route(view, request)
        self.seen.append((program, self.last.get(program, -1), load, choice))
        self.last[program] = choice
        return choice


def _run(max_excess, num_replicas=3, n=90):
    router = RecordingAffinity(max_excess=max_excess)
    cluster = Cluster(small_programs("copilot", n), num_replicas=num_replicas, router=router,
                      make_policy=lambda: make_builtin("vllm"), make_engine=sim_engine,
                      config=CONFIG)
    result = cluster.run()
    assert (result.state == RequestState.FINISHED).all()
    return router.seen, result


@pytest.mark.parametrize("max_excess", [0, 1, 2])
def test_a_call_follows_its_program_below_the_bound_and_moves_above_it(max_excess):
    seen, _ = _run(max_excess)
    stayed = moved = 0
    for program, previous, load, choice in seen:
        if previous >= 0 and load[previous] - load.min() <= max_excess:
            assert choice == previous  # below the bound: with its context
            stayed += 1
        else:  # a first call, or its replica over the bound: the least loaded
            assert load[choice] == load.min()
            moved += previous >= 0 and choice != previous
    assert stayed > 0
    if max_excess == 0:
        assert moved > 0  # the bound binds: some program's call left its replica


def test_below_a_loose_bound_every_program_stays_on_one_replica():
    seen, result = _run(max_excess=1000)
    programs = {}
    for program, _, _, choice in seen:
        programs.setdefault(program, set()).add(choice)
    assert all(len(replicas) == 1 for replicas in programs.values())
    assert len({next(iter(r)) for r in programs.values()}) > 1  # the programs still spread
    assert set(np.unique(result.replica).tolist()) == {0, 1, 2}


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_excess must be >= 0"):
        ProgramAffinity(max_excess=-1)
