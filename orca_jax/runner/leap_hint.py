"""The hint a simulated run of a plugin policy that never leaps ends with.

A policy that promises nothing (`Policy.stable_steps` returns None, the default) is
planned step by step: on a long simulation that is most of the host time (a plugin ran
4x slower than `vllm`, "leaped over 0 of 18,542 steps"). A built-in that promises
nothing does so on purpose (its plans read the clock or keep counts), so only a
policy from outside the `policies` package gets the hint; it names the one-line
opt-in and when it is safe (docs/writing_a_policy.md, "Leaping").
"""

from __future__ import annotations

import textwrap
from typing import Optional

from orca_jax.core.api.policy import resolve_policy_class
from orca_jax.core.loop.leap import promise_covers_schedule
from orca_jax.runner.spec import RunSpec, SimEngineSpec

BUILT_IN_PACKAGE = "policies"  # the built-in policies' package: they never get the hint
OPT_IN = ("def stable_steps(self, view): return 1 << 30 if self.schedule(view)"
          ".request_ids.size == view.running.size else None")


def leaps_for(spec: RunSpec) -> bool:
    """Whether the run would leap over a promising policy's steady steps at all."""
    return (isinstance(spec.engine, SimEngineSpec) and spec.engine.leap
            and not spec.limits.count_host_time)


def is_built_in(policy_type: type) -> bool:
    """Whether `policy_type` comes from the built-in `policies` package."""
    module = policy_type.__module__ or ""
    return module == BUILT_IN_PACKAGE or module.startswith(BUILT_IN_PACKAGE + ".")


def leap_hint(spec: RunSpec, policy_spec: str) -> Optional[str]:
    """One line for a run of `policy_spec` whose steps are all planned one by one because
    the policy, a plugin, promises no steady steps; None where the run leaps anyway, the
    policy promises, or it is a built-in (which never leaps on purpose)."""
    policy_type = resolve_policy_class(policy_spec)
    if not leaps_for(spec) or is_built_in(policy_type) or promise_covers_schedule(
            policy_type):
        return None
    prose = (f"hint: policy {policy_spec} promises no steady steps, so the simulator "
             "planned every step one by one. If its plan stays the same while only decodes "
             "happen (it reads no clock, keeps no count between calls, preempts at no page "
             "threshold), add this method to leap over such steps (docs/writing_a_policy.md, "
             "Leaping):")
    # Terminal lines of at most 100 columns; the method on a line of its own, to paste.
    return textwrap.fill(prose, 100, subsequent_indent="  ") + f"\n    {OPT_IN}"
