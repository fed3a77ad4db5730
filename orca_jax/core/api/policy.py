"""The policy API and its registry.

A policy is one small class in one file (gemma's sampler shape): its knobs are
dataclass fields, its own bookkeeping (queues, counters, predictions) lives in
fields with `init=False`, and it has one method, `schedule(view) -> StepPlan`.

    @register("fcfs")
    @dataclasses.dataclass(kw_only=True)
    class FCFS(Policy):
        max_running: int = 64

        def schedule(self, view: SchedulerView) -> StepPlan:
            ...

Policies are loaded by registered name (`orca`), by `package.module:Class`, or
by `path/to/file.py:Class`; `--policy_opts key=value,...` set their fields.
Policies never import jax: decisions are plain Python and numpy.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Mapping, Sequence, Type, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api import plugins
from orca_jax.core.api.plugins import PolicyLoadError, parse_options  # noqa: F401  (the policy API)
from orca_jax.core.plans.limits import StepLimits
from orca_jax.core.plans.plan import StepPlan
from orca_jax.core.plans.view import SchedulerView

KV_RESERVATIONS = ("none", "max", "pow2", "exact")  # the values of `Policy.kv_reservation`

_REGISTRY: dict[str, type["Policy"]] = {}


class Policy(abc.ABC):
    """Base class of every scheduling policy.

    Class attributes a policy may override (as plain class attributes or as
    dataclass fields, to make them knobs):
      name: the registered name (set by `register`).
      kv_reservation: how the core allocates KV pages for this policy:
        `none` (on demand, page by page, as vLLM), `max` (a request's whole
        context, max_model_len, at admission, as Orca), `pow2` (prompt + output
        rounded up to a power of two), `exact` (prompt + output: an oracle).
      defer_release: when True, finished requests are handed back to their
        clients only when the policy lists them in `StepPlan.release` (as
        request-level batching returns a whole batch at once).
      prefix_caching: True opts in to prefix caching (active when
        `SchedulerConfig.kv.enable_prefix_caching` is on too): an admission then
        starts past the cached pages of its prompt, so the tokens a plan gives a
        waiting request count from there (`view.cached_tokens`).
      renamed_options: old knob name -> new name, for knobs renamed in a release;
        `--policy_opts` still takes the old name, with a DeprecationWarning.
      preempts: False for a policy that never preempts: it cannot free pages when
        an on-demand pool runs out, so it refuses `kv_reservation = "none"` at
        load time (`make_policy` raises PolicyLoadError).
    """

    name: ClassVar[str] = ""
    renamed_options: ClassVar[Mapping[str, str]] = {}
    kv_reservation: str = "none"
    defer_release: bool = False
    prefix_caching: bool = False
    preempts: ClassVar[bool] = True

    def preemption_modes(self, view: SchedulerView, victims: NDArray[np.int64]
                         ) -> Union[str, Sequence[str]]:  # victims: [p]
        """How the core takes the KV of the requests this step's plan preempts off the
        device: one registered mode (`orca_jax.core.kv.preemption`) for all, or one per
        victim. `recompute` (the default): their pages are freed and they compute their
        context again when readmitted."""
        del view, victims
        return "recompute"

    def check_limits(self, limits: StepLimits) -> None:
        """Refuses, before anything runs, scheduler limits under which this policy's
        knobs cannot serve every request the core admits (the default accepts any).
        The scheduler calls it when built; `runner.build.check_policies` before a run.

        Raises:
          ValueError: one line naming the policy, its knob and the limit.
        """
        del limits

    @abc.abstractmethod
    def schedule(self, view: SchedulerView) -> StepPlan:
        """Decides one iteration.

        Args:
          view: the read-only view of the scheduler.

        Returns:
          The step's plan.
        """


register = plugins.registrar(_REGISTRY, Policy, kind="policy", decorator="register")


def registered_policies() -> dict[str, type[Policy]]:
    """The registered policies by name (a copy)."""
    return dict(_REGISTRY)


def resolve_policy_class(spec: str) -> type[Policy]:
    """Finds the policy class for a registered name, `module:Class` or `file.py:Class`."""
    return plugins.resolve_class(spec, kind="policy", plural="policies", registry=_REGISTRY,
                                 base=Policy)


def make_policy(spec: str, options: Mapping[str, str] | None = None) -> Policy:
    """Builds a policy from its spec and string options (`--policy_opts`).

    Args:
      spec: a registered name, `package.module:Class`, or `path/to/file.py:Class`.
      options: field name → value as text; converted to the field's type.

    Returns:
      A new policy instance.

    Raises:
      PolicyLoadError: the spec does not resolve, or an option names no field
        or has a value of the wrong type (the message names policy and option).
    """
    cls = resolve_policy_class(spec)
    policy = plugins.build(cls, options, "policy")
    check_kv_reservation(policy, PolicyLoadError)
    return policy


def check_kv_reservation(policy: Policy, error: Type[Exception]) -> None:
    """Raises `error` (one line naming policy and knob) if the policy's `kv_reservation`
    is unknown, or `none` for a policy that never preempts (`Policy.preempts`)."""
    if policy.kv_reservation not in KV_RESERVATIONS:
        raise error(f"policy {policy.name!r}: kv_reservation {policy.kv_reservation!r} "
                    f"is not one of {KV_RESERVATIONS}")
    if policy.kv_reservation == "none" and not policy.preempts:
        raise error(f"policy {policy.name!r}: kv_reservation 'none' takes KV pages as requests "
                    "grow, and this policy never preempts to free them when the pool runs "
                    f"out; use one of {KV_RESERVATIONS[1:]}")
