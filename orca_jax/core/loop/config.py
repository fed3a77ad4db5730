"""SchedulerConfig: the mechanism's settings, in parts (policy knobs live on the policy).

Each part is a small frozen dataclass that checks its own fields, kept where its
concept lives: `limits` (`StepLimits`, core/plans), `kv` (`KVConfig`, core/kv),
`sampling` (`SamplingConfig`, core/step), `slo` (`SLOTargets`, core/plans) and
`features` (`LoopFeatures`, here: what the loop does besides scheduling).

0.1's flat form, `SchedulerConfig(max_num_seqs=4, num_kv_pages=64)`, keeps working
for one release with a DeprecationWarning naming each keyword's part (the
metaclass), and so do flat reads (`config.page_size`); a knob's name is the same
in its part as it was flat.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from orca_jax.core.kv.config import KVConfig, prefix_caching_of_old_knob
from orca_jax.core.plans.limits import SLOTargets, StepLimits
from orca_jax.core.step.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopFeatures:
    """What the loop does besides scheduling: clock, overlap, logs and the handoff.

    Attributes:
      count_host_time: add measured host time to the virtual clock (then runs
        are no longer bit-for-bit repeatable).
      overlap: plan and pack step N+1 while step N runs, its decodes fed step N's
        tokens on the device and N's tokens read back one step late
        (`orca_jax.core.loop.executor`); plans, steps and tokens are the same as without.
        Needs an engine that `feeds_tokens`, and not active with prefix caching
        (pages are named by token values before the next plan) or `kv_handoff` (the
        transfer carries the first token); else it runs in step.
      log_step_requests: record which requests each step computed, how many tokens
        each (draft tokens included), and which hold a batch place after it
        (`RunResult.step_requests`, `step_tokens`, `step_held`; memory grows with
        steps x batch).
      kv_handoff: a finished request keeps its KV pages (in `in_transfer`) until a
        transfer hands them on (`orca_jax.cluster.handoff`: a disaggregated prefill replica).
      leap: run stretches of steady decode steps at once where the policy promises its
        plan repeats (`Policy.stable_steps`) and the engine prices spans (the simulator):
        the same results bit for bit, fewer host operations (`orca_jax.core.loop.leap`).
        Only at depth 1, without `count_host_time`, and not for a replica of a cluster.
      balance_micro_batches: through pipeline stages (`orca_jax.core.loop.pipeline`),
        let each micro-batch take at most `ceil(R / P)` of the `R` running requests (the
        rest wait for the next injection: `SchedulerView.busy`), so the `P` micro-batches
        in flight hold even shares and the stage times stay even. No effect on one stage.
      spec_k: speculative decoding at a fixed k (`--spec_k`): each decode of a plan gets
        up to this many draft tokens to verify (`policy_helpers.add_drafts`: within its
        output, the context, the token budget and the KV pages), for every policy that
        does not plan speculation itself (`Policy.plans_speculation`). 0: none. Needs an
        engine that speculates (`Engine.speculates`); docs/speculative.md.
    """

    count_host_time: bool = False
    overlap: bool = False
    log_step_requests: bool = False
    kv_handoff: bool = False
    leap: bool = False
    balance_micro_batches: bool = False
    spec_k: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.spec_k, bool) or not isinstance(self.spec_k, int) or self.spec_k < 0:
            raise ValueError(f"spec_k must be an integer >= 0, got {self.spec_k!r}")


# Part name -> its class, in SchedulerConfig's field order.
PARTS: dict[str, type] = {"limits": StepLimits, "kv": KVConfig, "sampling": SamplingConfig,
                          "slo": SLOTargets, "features": LoopFeatures}
# 0.1's flat keyword -> the part that holds it now (under the same name).
FLAT_KNOBS: dict[str, str] = {field.name: part for part, kind in PARTS.items()
                              for field in dataclasses.fields(kind)}
FLAT_KNOBS["enable_prefix_caching"] = "kv"  # 0.2's name of kv.prefix_caching (KVConfig says)


class _TakesFlatKeywords(type):
    """SchedulerConfig's metaclass: a call with 0.1's flat keywords builds the parts they
    mean, with one DeprecationWarning naming each one's new place, for one release (as
    `RunSpec`'s metaclass does for its flat form). Every other call is the dataclass's."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        flat = [name for name in kwargs if name in FLAT_KNOBS]
        if not flat:
            return super().__call__(*args, **kwargs)
        parts = [name for name in kwargs if name in PARTS]
        if parts:
            raise TypeError(f"SchedulerConfig: flat keyword {flat[0]!r} beside the part "
                            f"{parts[0]!r}: give {flat[0]} inside "
                            f"{FLAT_KNOBS[flat[0]]}={PARTS[FLAT_KNOBS[flat[0]]].__name__}(...)")
        grouped: dict[str, dict[str, Any]] = {}
        for name in flat:
            grouped.setdefault(FLAT_KNOBS[name], {})[name] = kwargs.pop(name)
        new_style = ", ".join(
            f"{part}={PARTS[part].__name__}({', '.join(f'{k}=...' for k in knobs)})"
            for part, knobs in grouped.items())
        warnings.warn(f"SchedulerConfig({', '.join(f'{k}=...' for k in flat)}): 0.1's flat "
                      "keywords are deprecated and go in the next release; write "
                      f"SchedulerConfig({new_style})", DeprecationWarning, stacklevel=2)
        return super().__call__(*args, **kwargs, **{part: PARTS[part](**knobs)
                                                    for part, knobs in grouped.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(metaclass=_TakesFlatKeywords):
    """The mechanism's settings, in parts (each part's own docstring says its knobs).

    Attributes:
      limits: what one step may hold, the context limit, the no-progress limit.
      kv: the KV pool: pages, page size, watermark, layout, prefix caching.
      sampling: every request's sampling parameters and the run's seed.
      slo: the run's SLOs, for policies to read.
      features: host time on the clock, overlap, step logs, the KV handoff.
    """

    limits: StepLimits = dataclasses.field(default_factory=StepLimits)
    kv: KVConfig = dataclasses.field(default_factory=KVConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    slo: SLOTargets = dataclasses.field(default_factory=SLOTargets)
    features: LoopFeatures = dataclasses.field(default_factory=LoopFeatures)

    def __post_init__(self) -> None:
        for part, kind in PARTS.items():
            value = getattr(self, part)
            if not isinstance(value, kind):
                raise TypeError(f"SchedulerConfig.{part} must be a {kind.__name__}, "
                                f"got {value!r}")

    def with_knobs(self, **knobs: Any) -> "SchedulerConfig":
        """A copy with these knobs changed, each in its part (`with_knobs(num_kv_pages=8,
        max_num_seqs=4)` changes `kv` and `limits`); a knob's name is its field's.

        Raises:
          TypeError: a name that is no part's field.
        """
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in knobs.items():
            if name == "enable_prefix_caching":  # 0.2's name, for one release
                name, value = "prefix_caching", prefix_caching_of_old_knob(value)
            if name not in FLAT_KNOBS:
                raise TypeError(f"SchedulerConfig.with_knobs: {name!r} is no knob of any part "
                                f"({', '.join(PARTS)})")
            grouped.setdefault(FLAT_KNOBS[name], {})[name] = value
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **new)
                                            for part, new in grouped.items()})

    def __getattr__(self, name: str) -> Any:
        """0.1's flat reads (`config.page_size`), with a DeprecationWarning naming the
        part; only names no attribute has reach here."""
        part = FLAT_KNOBS.get(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"SchedulerConfig.{name} is deprecated and goes in the next release; "
                      f"read SchedulerConfig.{part}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(getattr(self, part), name)
