"""orca_jax: iteration-level scheduling of LLM serving, for research on policies.

The package face is the plugin API: what a policy or router module imports
(a policy: `Policy`, `register`, `SchedulerView`, `StepPlan`, `plan_in_order`;
a router: `Router`, `register_router`, `ClusterView`).
It is host-side only (numpy, no jax), so policies and the simulator import
without jax. The parts live in subpackages, in layers that only look down:

    core/       requests, plans and their checks, the view, the scheduler, KV pages,
                packing, the engine contract, the policy API and plugin loading, RunResult
    specs/      model shapes and hardware datasheets (one preset table each)
    model/      the Flax decoder and the jitted engine (jax lives here)
    sim/        the cost-model engine, step profiles and the fit to a real engine
    workloads/  synthetic workloads and trace files
    learned/    length predictors and the learned ranker
    cluster/    replicas behind a router
    results/    metrics, summaries, results files, the sweep store, plots
    runner/     a run assembled from its spec: workload, engine, policy -> results

Each subpackage's `__init__.py` says what it owns and what it may import;
`tests/test_architecture.py` holds those rules.
"""

from orca_jax import _legacy
from orca_jax.cluster.routing import ClusterView, Router, register_router
from orca_jax.core.api.plugins import PolicyLoadError, parse_options
from orca_jax.core.api.policy import Policy, make_policy, register, registered_policies
from orca_jax.core.api.policy_helpers import fit_to_budget, plan_in_order
from orca_jax.core.kv.config import KVConfig
from orca_jax.core.loop.config import LoopFeatures, SchedulerConfig
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.plans.limits import SLOTargets, StepLimits
from orca_jax.core.plans.plan import PlanError, StepPlan
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.step.engine_api import Bucket, Engine, StepInputs, StepOutput
from orca_jax.core.step.sampling import SamplingConfig

_legacy.install()

__version__ = "0.2.0"  # setup.cfg's version says the same (tests/test_version.py)

__all__ = [
    "Bucket", "ClusterView", "Engine", "KVConfig", "LoopFeatures", "PlanError", "Policy",
    "PolicyLoadError", "Request", "RequestState", "Router", "SLOTargets", "SamplingConfig",
    "Scheduler", "SchedulerConfig", "SchedulerView", "StepInputs", "StepLimits", "StepOutput",
    "StepPlan", "fit_to_budget", "make_policy", "parse_options", "plan_in_order", "register",
    "register_router", "registered_policies",
]
