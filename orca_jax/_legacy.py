"""The module paths of the flat layout (before 0.2), kept importable for one release.

`from orca_jax.policy import Policy, register` and the like, as plugins written
against the old docs do, load the module at its new place and warn once
(DeprecationWarning). Nothing is imported until such a path is asked for, so
the package face stays free of jax.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Optional, Sequence

# old module -> its place now
MOVED: dict[str, str] = {
    "orca_jax.request": "orca_jax.core.request",
    "orca_jax.request_table": "orca_jax.core.request_table",
    "orca_jax.plan": "orca_jax.core.plan",
    "orca_jax.plan_checks": "orca_jax.core.plan_checks",
    "orca_jax.view": "orca_jax.core.view",
    "orca_jax.scheduler": "orca_jax.core.scheduler",
    "orca_jax.kv_cache": "orca_jax.core.kv",
    "orca_jax.core.kv_pages": "orca_jax.core.kv",
    "orca_jax.core.buddy": "orca_jax.core.kv.buddy",
    "orca_jax.core.prefix_cache": "orca_jax.core.kv.prefix_cache",
    "orca_jax.core.prefix_hits": "orca_jax.core.kv.prefix_hits",
    "orca_jax.packing": "orca_jax.core.packing",
    "orca_jax.engine_api": "orca_jax.core.engine_api",
    "orca_jax.policy": "orca_jax.core.policy",
    "orca_jax.plugins": "orca_jax.core.plugins",
    "orca_jax.policy_helpers": "orca_jax.core.policy_helpers",
    "orca_jax.run_record": "orca_jax.core.run_record",
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
