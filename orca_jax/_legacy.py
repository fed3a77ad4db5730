"""0.1's public names, kept working for one release with a DeprecationWarning.

The module paths of the flat layout: `from orca_jax.policy import Policy,
register` and the like, as plugins written against the old docs do, load the
module at its new place and warn once. Nothing is imported until such a path
is asked for, so the package face stays free of jax.

0.1's flat `RunSpec(engine="sim", rate=8.0, max_batch_size=32, ...)`: its
keywords become the nested spec's parts (`nested_run_spec_keywords`, called by
`RunSpec`'s metaclass). (`policies._common.plan_in_order` warns in its module.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Mapping, Optional, Sequence

# old module -> its place now
MOVED: dict[str, str] = {
    "orca_jax.request": "orca_jax.core.requests.request",
    "orca_jax.request_table": "orca_jax.core.requests.request_table",
    "orca_jax.plan": "orca_jax.core.plans.plan",
    "orca_jax.plan_checks": "orca_jax.core.plans.plan_checks",
    "orca_jax.view": "orca_jax.core.plans.view",
    "orca_jax.scheduler": "orca_jax.core.loop.scheduler",
    "orca_jax.kv_cache": "orca_jax.core.kv",
    # 0.2's folders inside the core (issue 24): the flat core modules of before.
    "orca_jax.core.request": "orca_jax.core.requests.request",
    "orca_jax.core.request_table": "orca_jax.core.requests.request_table",
    "orca_jax.core.run_record": "orca_jax.core.requests.run_record",
    "orca_jax.core.run_result": "orca_jax.core.requests.run_result",
    "orca_jax.core.engine_api": "orca_jax.core.step.engine_api",
    "orca_jax.core.packing": "orca_jax.core.step.packing",
    "orca_jax.core.bucket_fit": "orca_jax.core.step.bucket_fit",
    "orca_jax.core.plan": "orca_jax.core.plans.plan",
    "orca_jax.core.plan_checks": "orca_jax.core.plans.plan_checks",
    "orca_jax.core.scheduler_state": "orca_jax.core.plans.scheduler_state",
    "orca_jax.core.view": "orca_jax.core.plans.view",
    "orca_jax.core.policy": "orca_jax.core.api.policy",
    "orca_jax.core.plugins": "orca_jax.core.api.plugins",
    "orca_jax.core.policy_helpers": "orca_jax.core.api.policy_helpers",
    "orca_jax.core.scheduler": "orca_jax.core.loop.scheduler",
    "orca_jax.core.admission": "orca_jax.core.loop.admission",
    "orca_jax.core.progress": "orca_jax.core.loop.watchdog",
    "orca_jax.core.handoff": "orca_jax.cluster.handoff",
    "orca_jax.core.kv_pages": "orca_jax.core.kv",
    "orca_jax.core.buddy": "orca_jax.core.kv.buddy",
    "orca_jax.core.prefix_cache": "orca_jax.core.kv.prefix_cache",
    "orca_jax.core.prefix_hits": "orca_jax.core.kv.prefix_hits",
    "orca_jax.packing": "orca_jax.core.step.packing",
    "orca_jax.engine_api": "orca_jax.core.step.engine_api",
    "orca_jax.policy": "orca_jax.core.api.policy",
    "orca_jax.plugins": "orca_jax.core.api.plugins",
    "orca_jax.policy_helpers": "orca_jax.core.api.policy_helpers",
    "orca_jax.run_record": "orca_jax.core.requests.run_record",
    "orca_jax.model_config": "orca_jax.specs.model_config",
    "orca_jax.hardware_presets": "orca_jax.specs.hardware",
    "orca_jax.sampling": "orca_jax.model.sampling",
    "orca_jax.weights": "orca_jax.model.weights",
    "orca_jax.sharding": "orca_jax.model.sharding",
    "orca_jax.jax_engine": "orca_jax.model.engine",
    "orca_jax.cost_model": "orca_jax.sim.cost_model",
    "orca_jax.sim_engine": "orca_jax.sim.engine",
    "orca_jax.step_profile": "orca_jax.sim.step_profile",
    "orca_jax.calibration": "orca_jax.sim.calibration",
    "orca_jax.workload": "orca_jax.workloads.synthetic",
    "orca_jax.traces": "orca_jax.workloads.traces",
    "orca_jax.routing": "orca_jax.cluster.routing",
    "orca_jax.ranker": "orca_jax.learned.ranker",
    "orca_jax.length_predictor": "orca_jax.learned.length_predictor",
    "orca_jax.metrics": "orca_jax.results.metrics",
    "orca_jax.sweep_store": "orca_jax.results.sweep_store",
    "orca_jax.plots": "orca_jax.results.plots",
    "orca_jax.experiment": "orca_jax.runner.experiment",
}
# `orca_jax.model`, `orca_jax.cluster` and `orca_jax.results` are packages now: the old
# modules of those names are `orca_jax.model.llama`, `orca_jax.cluster.replicas` and
# `orca_jax.results.summary`, whose public names the packages re-export.


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module at its new place."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module was loaded at its new place."""


def install() -> None:
    """Puts the finder on `sys.meta_path` once."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


# 0.1's flat RunSpec keywords -> (part, field) of the nested RunSpec: "run" is RunSpec's
# own field; "jax" and "sim" are the engine parts, of which `engine=` (default "sim")
# picks one. The renamed ones: workload -> arrival, max_batch_size -> max_num_seqs,
# token_budget -> max_num_tokens.
FLAT_RUN_SPEC: dict[str, tuple[str, str]] = {
    "model": ("engine", "model"), "tp": ("engine", "tp"),
    **{name: ("jax", name) for name in ("checkpoint", "dtype", "attention", "sampling",
                                        "clock")},
    **{name: ("sim", name) for name in ("hardware", "step_time_ms", "cost_fit")},
    "workload": ("workload", "arrival"),
    **{name: ("workload", name) for name in ("trace", "trace_time_scale", "num_requests",
                                             "rate", "cv", "prompt_len", "output_len")},
    "max_batch_size": ("limits", "max_num_seqs"), "token_budget": ("limits", "max_num_tokens"),
    **{name: ("limits", name) for name in ("num_kv_pages", "kv_memory_gb", "page_size",
                                           "max_model_len", "token_buckets",
                                           "log_step_requests")},
    **{name: ("cluster", name) for name in ("num_replicas", "router", "router_opts")},
    **{name: ("run", name) for name in ("seed", "ttft_slo_s", "tpot_slo_s")},
}
_PART_CLASSES = {"workload": "WorkloadSpec", "engine": None, "limits": "LimitsSpec",
                 "cluster": "ClusterSpec"}


def nested_run_spec_keywords(flat: Mapping[str, object],
                             parts: Mapping[str, type]) -> dict[str, object]:
    """The nested `RunSpec` keywords that 0.1's flat ones mean, with a DeprecationWarning.

    As in 0.1, a setting of the engine not chosen (`hardware` on `engine="jax"`) is
    ignored; the warning names it.

    Args:
      flat: `RunSpec`'s keywords as 0.1 took them (`engine` a kind name).
      parts: the part classes by part (`workload`, `limits`, `cluster`) and by engine kind
        (`jax`, `sim`).

    Raises:
      TypeError: a keyword that is neither 0.1's nor a field, or flat keywords beside
        nested parts.
      ValueError: an engine kind other than 0.1's `sim` or `jax`.
    """
    nested = sorted(flat.keys() - FLAT_RUN_SPEC.keys() - {"engine"})
    if nested:
        flat_names = sorted(flat.keys() & FLAT_RUN_SPEC.keys())
        raise TypeError(f"RunSpec: {nested[0]!r} is no field of 0.1's flat RunSpec, beside its "
                        f"flat keywords {flat_names}: give the nested parts alone "
                        "(workload=WorkloadSpec(...), engine=..., limits=LimitsSpec(...), "
                        "cluster=ClusterSpec(...))")
    kind = flat.get("engine", "sim")
    if kind not in ("sim", "jax"):
        raise ValueError(f"RunSpec: engine={kind!r}: 0.1's flat engine is 'sim' or 'jax'")
    grouped: dict[str, dict[str, object]] = {part: {} for part in _PART_CLASSES}
    run: dict[str, object] = {}
    ignored = []
    for old, value in flat.items():
        if old == "engine":
            continue
        part, field = FLAT_RUN_SPEC[old]
        if part in ("jax", "sim"):
            if part != kind:
                ignored.append(old)
                continue
            part = "engine"
        (run if part == "run" else grouped[part])[field] = value
    classes = {**_PART_CLASSES, "engine": parts[kind].__name__}
    new_style = ", ".join(
        [f"{part}={classes[part]}({', '.join(f'{k}=...' for k in fields)})"
         for part, fields in grouped.items() if fields or part == "engine"]
        + [f"{k}=..." for k in run])
    warnings.warn(f"RunSpec({', '.join(f'{k}=...' for k in flat)}): 0.1's flat keywords are "
                  f"deprecated and go in the next release; write RunSpec({new_style})"
                  + (f" ({', '.join(ignored)} ignored: not settings of engine {kind!r})"
                     if ignored else ""), DeprecationWarning, stacklevel=3)
    return {**run, "engine": parts[kind](**grouped["engine"]),
            **{part: parts[part](**grouped[part]) for part in ("workload", "limits", "cluster")}}
