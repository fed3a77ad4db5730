"""The gateways' routers (`power_of_two`, `length_buckets`, `kv_aware`): properties of every
decision they make over random clusters, read back through recording subclasses."""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView, make_router
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload
from policies.gateway_routers import PowerOfTwo

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=160, page_size=16))


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))


def _workload(n=80, rate=200.0, seed=3, prompt_len="uniform:8:200"):
    return synthetic_workload(num_requests=n, arrival="poisson", rate=rate,
                              prompt_len=prompt_len, output_len="uniform:1:60", seed=seed)


def _run(requests, num_replicas, router, *, seed=0, config=CONFIG, **options):
    config = dataclasses.replace(config, sampling=SamplingConfig(seed=seed))
    cluster = Cluster(requests, num_replicas=num_replicas, router=router,
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=config, router_options={k: str(v) for k, v in options.items()})
    return cluster.run()


# ------------------------------------------------------------------ power_of_two
@dataclasses.dataclass
class RecordingPowerOfTwo(PowerOfTwo):
    """power_of_two that records each decision's two draws, the loads and the choice."""

    seen: list = dataclasses.field(default_factory=list)
    _pair: tuple = ()

    def sample(self, view: ClusterView) -> tuple[int, int]:
        self._pair = super().sample(view)
        return self._pair

    def route(self, view: ClusterView, request: int) -> int:
        choice = super().route(view, request)
        self.seen.append((self._pair, view.outstanding().copy(), choice))
        return choice


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_of_two_never_picks_the_more_loaded_of_its_two_draws(seed):
    router = RecordingPowerOfTwo()
    result = _run(_workload(seed=seed), 4, router, seed=seed)
    assert len(router.seen) == 80
    imbalanced = 0
    for (first, second), load, choice in router.seen:
        assert first != second and choice in (first, second)
        other = second if choice == first else first
        assert load[choice] <= load[other]
        if load[first] == load[second]:
            assert choice == first  # a tie goes to the first drawn, as sgl-router's
        imbalanced += load[first] != load[second]
    assert imbalanced > 10  # the loads differed often enough for the rule to matter
    assert set(result.replica.tolist()) == {0, 1, 2, 3}


def test_power_of_two_draws_from_the_run_seed():
    requests = _workload()
    first = _run(requests, 4, "power_of_two", seed=5).replica
    np.testing.assert_array_equal(_run(requests, 4, "power_of_two", seed=5).replica, first)
    assert (_run(requests, 4, "power_of_two", seed=6).replica != first).any()
    # One replica: no draw, no error.
    assert (_run(requests[:5], 1, "power_of_two").replica == 0).all()


def test_power_of_two_has_no_knobs():
    with pytest.raises(PolicyLoadError, match="router 'power_of_two' has no option 'k'"):
        make_router("power_of_two", {"k": "3"})
