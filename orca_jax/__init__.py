"""orca_jax: iteration-level scheduling of LLM serving, for research on policies.

This package's top level is host-side only (numpy, no jax), so that policies
and the simulator import without jax; the model and the jitted engine live in
`orca_jax.model` and `orca_jax.jax_engine`.
"""

from orca_jax.engine_api import Bucket, Engine, StepInputs, StepOutput
from orca_jax.plan import PlanError, StepPlan
from orca_jax.policy import Policy, make_policy, register
from orca_jax.request import Request, RequestState
from orca_jax.scheduler import Scheduler, SchedulerConfig
from orca_jax.view import SchedulerView

__all__ = [
    "Bucket", "Engine", "PlanError", "Policy", "Request", "RequestState", "Scheduler",
    "SchedulerConfig", "SchedulerView", "StepInputs", "StepOutput", "StepPlan", "make_policy",
    "register",
]
