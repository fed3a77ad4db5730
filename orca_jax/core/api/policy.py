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
import dataclasses
from typing import ClassVar, Mapping, Optional, Sequence, Type, Union

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

    Besides `schedule`, a policy may promise that its plan repeats over steady
    decode steps (`stable_steps`; none by default): the simulator then leaps
    over them.

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
      prefix_caching: True opts in to prefix caching. The run's switch
        (`SchedulerConfig.kv.prefix_caching`, `--prefix_caching`) decides:
        `policy` (the default) follows this opt-in, `on` turns caching on
        whatever it says, `off` off. With caching active (`view.prefix_caching`)
        an admission starts past the cached pages of its prompt, so the tokens a
        plan gives a waiting request count from there (`view.requests.
        num_uncomputed - view.cached_tokens`), and a preemption frees a shared
        page only with its last holder (`view.pages_freed`); a policy that plans
        through `plan_in_order` or `view.kv_budget` gets both from them.
      prefix_caching_knob: the knob (a dataclass field) that sets `prefix_caching`,
        if any (vllm: `enable_prefix_caching`): a command refuses it given
        explicitly against the run's `on`/`off` (`runner.build.check_prefix_caching`).
      prefix_caching_unsupported: why this policy cannot plan with shared pages,
        if it cannot (empty: it can); the run's `on` then refuses it, naming the
        policy and this reason, instead of running it uncached.
      renamed_options: old knob name -> new name, for knobs renamed in a release;
        `--policy_opts` still takes the old name, with a DeprecationWarning.
      plans_speculation: True for a policy that sets `StepPlan.spec_tokens` itself
        (smartspec); the run's fixed `--spec_k` (`LoopFeatures.spec_k`) is added to the
        plans of every other policy (`policy_helpers.add_drafts`).
      preempts: False for a policy that never preempts: it cannot free pages when
        an on-demand pool runs out, so it refuses `kv_reservation = "none"` at
        load time (`make_policy` raises PolicyLoadError).
      stable_through_finishes: True widens what `stable_steps` answers for to the step
        after one in which running requests finished (see there); False (the
        default) asks `schedule()` then.
      stable_after_prefills: True widens it to the step after one in which every
        planned request computed all it knew, prefills ending their prompts among
        them (see `stable_steps`); False (the default) asks `schedule()` then.
    """

    name: ClassVar[str] = ""
    renamed_options: ClassVar[Mapping[str, str]] = {}
    kv_reservation: str = "none"
    defer_release: bool = False
    prefix_caching: bool = False
    prefix_caching_knob: ClassVar[str] = "prefix_caching"
    prefix_caching_unsupported: ClassVar[str] = ""
    preempts: ClassVar[bool] = True
    plans_speculation: ClassVar[bool] = False
    stable_through_finishes: ClassVar[bool] = False
    stable_after_prefills: ClassVar[bool] = False

    def preemption_modes(self, view: SchedulerView, victims: NDArray[np.int64]
                         ) -> Union[str, Sequence[str]]:  # victims: [p]
        """How the core takes the KV of the requests this step's plan preempts off the
        device: one registered mode (`orca_jax.core.kv.preemption`) for all, or one per
        victim. `recompute` (the default): their pages are freed and they compute their
        context again when readmitted."""
        del view, victims
        return "recompute"

    def kv_pin_s(self, view: SchedulerView, finished: NDArray[np.int64]
                 ) -> Union[float, Sequence[float]]:  # finished: [f]
        """Seconds the KV pages of each program call just finished stay pinned for its
        program (docs/programs.md): held on the device, counted against the pool, until
        a child call of the program is admitted (and shares them as a prefix hit), the
        time passes, or an admission needs them. 0 frees them at once (they stay cached,
        evictable); inf holds them until a child is admitted. Asked only with prefix
        caching active, for calls that have children. The default is the run's
        `--kv_pin_s` (`view.kv_pin_s`)."""
        del finished
        return view.kv_pin_s

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """How many next steps this policy promises to plan as the step just run (a
        leaping simulator runs them at once: `orca_jax.core.loop.leap`); None, the
        default, promises nothing and is asked again after every step.

        Asked only right after a step that computed one token of every running request
        (a decode of each, in the plan's order) and preempted, released and rejected
        nothing, with the view as the next `schedule()` would see it. Returning k
        promises: for each of the next k iterations, if nothing changes but those
        steps' own work — each running request computes one more token, pages are
        taken as the steps need them while the pool has them, the clock moves past
        each step — with no arrival, no finish before the last of them, no preemption
        and no change to the prefix cache, `schedule()` would return that same plan
        again (the same requests in the same order, one token each, nothing else),
        and not calling it changes none of this policy's later decisions. The
        executor stops a leap at every event itself (an arrival, a finish, a page the
        pool lacks, a prefix-cache page filled); the policy answers only for its own
        rules: its budget, its cap, admissions (whether a waiting request could get
        in), its reading of the clock and of its bookkeeping. Fewer steps is always
        a safe answer.

        Two class attributes widen when it is asked, and so what its answer promises
        (both False by default: the step after such a step is planned by `schedule()`):

        - `stable_through_finishes`: it is asked too right after such a step in which
          some running requests finished (or were stopped: `FINISHED`), with the view
          as the next `schedule()` would see it (they have left `view.running`, their
          pages are freed, and `view.last_finished` holds them). A k then promises
          the plan of the step just run minus the finished ones: the rest in the same
          order, one token each, with the same `min_bucket_tokens`, nothing released
          — and that the finishes themselves change none of its later decisions
          while `schedule()` is not called (a policy that counts them in `schedule()`,
          reading `view.last_finished`, must not set it).
        - `stable_after_prefills`: it is asked too right after a step in which every
          planned request computed all it knew (prefills that ended their prompts,
          decodes) and that preempted, released and rejected nothing; a k then
          promises each request of `view.running` one token, in `view.running`'s
          order (admission order), with the same `min_bucket_tokens`, nothing else.

        A promise holds for the `schedule` of the class that makes it (or of a class
        above it): a subclass that overrides `schedule` and not this is asked every
        step, whatever its parent promised; either attribute holds only where it is
        set by the class that defines `schedule` and `stable_steps` or below it.
        """
        del view
        return None

    def arrivals_wait(self, view: SchedulerView) -> bool:
        """Whether requests arriving during the steps `stable_steps` just promised would
        wait through them: asked right after it answered k >= 1, with the same view, when
        the next arrival may come before those k steps end (a lone replica without agent
        programs or slower KV tiers; any other arrival still ends a leap).

        True promises that for each of those steps `schedule()` would return the same
        plan with every request that arrived by the step's start in the waiting queue
        (each joins its tail, in arrival order, as the core adds arrivals), and that
        their joining changes none of this policy's later decisions while `schedule()`
        is not called (a policy that reads the queue's length in `schedule()` to keep
        some count must not say True). The leap then runs on past the arrivals, which
        join at the steps they would have joined at one by one. False, the default,
        ends the leap before the first arrival, as without it. It is also asked, as a
        hint that promises nothing, at a chance to leap when arrivals are due, before they
        join: False plans the next step without asking `stable_steps`. A True holds for the
        `schedule` of the class that defines this method (or a class above it), as a
        promise of `stable_steps` does.
        """
        del view
        return False

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


def prefix_caching_active(policy: Policy, mode: str, error: Type[Exception]) -> bool:
    """Whether prefix caching is active for `policy` under the run's switch `mode`
    (`KVConfig.prefix_caching`): `policy`, the policy's own opt-in; `on`, yes; `off`, no.

    Raises:
      error: `on` for a policy that declares `prefix_caching_unsupported` (one line
        naming the policy and its reason).
    """
    if mode == "policy":
        return bool(policy.prefix_caching)
    if mode == "on" and policy.prefix_caching_unsupported:
        raise error(f"policy {policy.name!r} cannot run with prefix_caching 'on': "
                    f"{policy.prefix_caching_unsupported}")
    return mode == "on"


def prefix_caching_line(cls: type[Policy]) -> str:
    """What a policy class does with prefix caching, in one line (`--describe_policy`)."""
    if cls.prefix_caching_unsupported:
        return (f"prefix caching: not supported ({cls.prefix_caching_unsupported}); "
                "--prefix_caching=on refuses it")
    knob = cls.prefix_caching_knob
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if knob in fields and fields[knob].init:  # a knob: its default is the opt-in
        opt_in = f"opts in by its knob {knob} (default {fields[knob].default!r})"
    else:
        opt_in = ("opts in" if getattr(cls, "prefix_caching", False) is True
                  else "does not opt in")
    return (f"prefix caching: {opt_in}, which decides under --prefix_caching=policy (the "
            "default); --prefix_caching=on caches for it too, =off never")


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
