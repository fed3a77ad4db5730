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
import importlib
import importlib.util
import os
import sys
import types
import typing
from typing import Any, Callable, ClassVar, Mapping, TypeVar, Union

from orca_jax.plan import StepPlan

KV_RESERVATIONS = ("none", "max", "pow2", "exact")
BUILTIN_POLICY_PACKAGE = "policies"

_REGISTRY: dict[str, type["Policy"]] = {}
P = TypeVar("P", bound=type)


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
    """

    name: ClassVar[str] = ""
    kv_reservation: str = "none"
    defer_release: bool = False

    @abc.abstractmethod
    def schedule(self, view: Any) -> StepPlan:
        """Decides one iteration.

        Args:
          view: a read-only `orca_jax.view.SchedulerView` of the scheduler.

        Returns:
          The step's plan.
        """


def register(name: str) -> Callable[[P], P]:
    """Class decorator registering a policy under `name`."""

    def wrap(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"@register({name!r}) expects a Policy subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"policy name {name!r} is already registered by "
                             f"{existing.__module__}.{existing.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_policies() -> dict[str, type[Policy]]:
    """The registered policies by name (a copy)."""
    return dict(_REGISTRY)


class PolicyLoadError(ValueError):
    """A policy spec or option could not be resolved; the message names it."""


def _import_from_file(path: str, spec: str) -> types.ModuleType:
    if not os.path.isfile(path):
        raise PolicyLoadError(f"policy {spec!r}: file {path!r} does not exist")
    module_name = "orca_jax_plugin_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise PolicyLoadError(f"policy {spec!r}: cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise PolicyLoadError(f"policy {spec!r}: importing {path!r} failed: "
                              f"{type(e).__name__}: {e}") from e
    return module


def resolve_policy_class(spec: str) -> type[Policy]:
    """Finds the policy class for a registered name, `module:Class` or `file.py:Class`."""
    if ":" not in spec:
        if spec not in _REGISTRY:
            # The built-in policies register themselves when their package is imported;
            # discover them by name so that orca_jax never imports `policies` statically.
            importlib.import_module(BUILTIN_POLICY_PACKAGE)
        if spec in _REGISTRY:
            return _REGISTRY[spec]
        known = ", ".join(sorted(_REGISTRY)) or "(none registered: import policies)"
        raise PolicyLoadError(f"unknown policy {spec!r}; registered policies: {known}; "
                              "or give package.module:Class or path/to/file.py:Class")
    where, _, class_name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_from_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise PolicyLoadError(f"policy {spec!r}: cannot import module {where!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PolicyLoadError(f"policy {spec!r}: {where!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyLoadError(f"policy {spec!r}: {class_name!r} is not an orca_jax Policy subclass")
    if not cls.name:
        cls.name = class_name.lower()
    return cls


def _convert(value: str, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(hint, types.UnionType)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value.lower() == "none" and len(args) < len(typing.get_args(hint)):
            return None
        errors = []
        for arg in args:
            try:
                return _convert(value, arg, where)
            except PolicyLoadError as e:
                errors.append(str(e))
        raise PolicyLoadError("; ".join(errors))
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        for choice in choices:
            if str(choice) == value:
                return choice
        raise PolicyLoadError(f"{where}: {value!r} is not one of {list(choices)}")
    if hint is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise PolicyLoadError(f"{where}: expected true/false, got {value!r}")
    if hint in (int, float, str):
        try:
            return hint(value)
        except ValueError:
            raise PolicyLoadError(f"{where}: expected {hint.__name__}, got {value!r}") from None
    raise PolicyLoadError(f"{where}: fields of type {hint!r} cannot be set from the command line")


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
    options = dict(options or {})
    kwargs: dict[str, Any] = {}
    if options:
        if not dataclasses.is_dataclass(cls):
            raise PolicyLoadError(f"policy {cls.name!r} has no options (it is not a dataclass), "
                                  f"got {sorted(options)}")
        hints = typing.get_type_hints(cls)
        settable = {f.name for f in dataclasses.fields(cls) if f.init}
        for key, value in options.items():
            if key not in settable:
                raise PolicyLoadError(f"policy {cls.name!r} has no option {key!r}; "
                                      f"options: {', '.join(sorted(settable)) or '(none)'}")
            kwargs[key] = _convert(value, hints[key], f"policy {cls.name!r} option {key!r}")
    try:
        policy = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise PolicyLoadError(f"policy {cls.name!r}: {e}") from e
    if policy.kv_reservation not in KV_RESERVATIONS:
        raise PolicyLoadError(f"policy {cls.name!r}: kv_reservation {policy.kv_reservation!r} "
                              f"is not one of {KV_RESERVATIONS}")
    return policy


def parse_options(text: str) -> dict[str, str]:
    """Parses `key=value,key=value` (the `--policy_opts` syntax)."""
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PolicyLoadError(f"policy option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    return options
