"""Loading decision plugins (policies, routers) by name, `module:Class` or `file.py:Class`.

A plugin kind has a registry (name -> class, filled by its `register`
decorator), a base class, and a built-in package that registers the built-ins
when imported (`policies`), so `orca_jax` never imports that package
statically. Knobs are dataclass fields, set from text options (`key=value`)
converted to each field's type. A plugin class that renamed a knob lists it in
`renamed_options` (old name -> new name): the old name still sets the knob,
with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import types
import typing
import warnings
from typing import Any, Callable, Mapping, MutableMapping, Optional, TypeVar, Union

BUILTIN_PACKAGE = "policies"  # registers the built-in policies and routers when imported
C = TypeVar("C", bound=type)


class PolicyLoadError(ValueError):
    """A policy or router spec or option could not be resolved; the message names it."""


def declared_with(plugin_type: type, attribute: str, method: str) -> bool:
    """Whether `plugin_type`'s `attribute` (a promise about `method`: a policy's
    `stable_steps` about its `schedule`, a router's `state_blind` about its `route`) is
    defined by the class that defines `method`, or by a subclass of it. A plugin that
    overrides a built-in's `method` alone must not inherit the promise its parent made."""
    mro = plugin_type.__mro__

    def owner(name: str) -> int:
        return next(i for i, cls in enumerate(mro) if name in vars(cls))
    return owner(attribute) <= owner(method)


def registrar(registry: MutableMapping[str, type], base: type, *, kind: str,
              decorator: str) -> Callable[[str], Callable[[C], C]]:
    """The `@decorator(name)` class decorator that registers a `base` subclass in `registry`.

    It sets the class's `name`; registering another class under a taken name is
    an error (the same class again, e.g. on a module reload, is not).
    """

    def register(name: str) -> Callable[[C], C]:
        def wrap(cls: C) -> C:
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"@{decorator}({name!r}) expects a {base.__name__} subclass, "
                                f"got {cls!r}")
            existing = registry.get(name)
            if existing is not None and existing.__qualname__ != cls.__qualname__:
                raise ValueError(f"{kind} name {name!r} is already registered by "
                                 f"{existing.__module__}.{existing.__qualname__}")
            cls.name = name
            registry[name] = cls
            return cls

        return wrap

    register.__doc__ = f"Class decorator registering a {kind} under `name`."
    return register


def _class_not_named(path: str, kind: str, base: type) -> str:
    """The message for a plugin file given without its class: what to write, and the
    `base` subclasses the file defines where it loads (importing it, as naming one would)."""
    message = f"{kind} {path!r} names a file but no class: give {path}:ClassName"
    try:
        module = _import_from_file(path, path, kind)
    except PolicyLoadError as e:
        return f"{message} ({e})"
    found = sorted(name for name, value in vars(module).items()
                   if isinstance(value, type) and issubclass(value, base) and value is not base
                   and value.__module__ == module.__name__)  # not the ones it imports
    if not found:
        return f"{message}; it defines no {base.__name__} subclass"
    return (f"{message}; its {base.__name__} subclasses: "
            + ", ".join(f"{path}:{name}" for name in found))


def _import_from_file(path: str, spec: str, kind: str) -> types.ModuleType:
    if not os.path.isfile(path):
        raise PolicyLoadError(f"{kind} {spec!r}: file {path!r} does not exist")
    module_name = "orca_jax_plugin_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise PolicyLoadError(f"{kind} {spec!r}: cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    # A researcher's file, in any folder (shared, read-only, a run's own): loaded without
    # leaving a __pycache__ folder beside it.
    kept = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise PolicyLoadError(f"{kind} {spec!r}: importing {path!r} failed: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        sys.dont_write_bytecode = kept
    return module


def resolve_class(spec: str, *, kind: str, plural: str, registry: Mapping[str, type],
                  base: type) -> type:
    """Finds the class for a registered name, `module:Class` or `file.py:Class`.

    Args:
      spec: what the user wrote.
      kind, plural: the plugin kind for messages (`policy`, `policies`).
      registry: registered name -> class of this kind.
      base: the class every plugin of this kind subclasses.

    Raises:
      PolicyLoadError: the spec does not resolve to a subclass of `base`.
    """
    if ":" not in spec:
        if spec.endswith(".py") or "/" in spec or os.sep in spec:
            raise PolicyLoadError(_class_not_named(spec, kind, base))
        if spec not in registry:
            importlib.import_module(BUILTIN_PACKAGE)  # the built-ins register on import
        if spec in registry:
            return registry[spec]
        known = ", ".join(sorted(registry)) or f"(none registered: import {BUILTIN_PACKAGE})"
        raise PolicyLoadError(f"unknown {kind} {spec!r}; registered {plural}: {known}; "
                              "or give package.module:Class or path/to/file.py:Class")
    where, _, class_name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_from_file(where, spec, kind)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise PolicyLoadError(f"{kind} {spec!r}: cannot import module {where!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PolicyLoadError(f"{kind} {spec!r}: {where!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PolicyLoadError(f"{kind} {spec!r}: {class_name!r} is not an orca_jax "
                              f"{base.__name__} subclass")
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


def current_options(cls: type, options: Optional[Mapping[str, str]], kind: str
                    ) -> dict[str, str]:
    """`options` under the knobs' names now: each old name in `cls.renamed_options` is
    replaced by its new name, with a DeprecationWarning.

    Raises:
      PolicyLoadError: an old name and its new name are both given, with different values.
    """
    renamed: Mapping[str, str] = getattr(cls, "renamed_options", {})
    current = {key: value for key, value in (options or {}).items() if key not in renamed}
    for old, value in (options or {}).items():
        if old not in renamed:
            continue
        new = renamed[old]
        if current.get(new, value) != value:
            raise PolicyLoadError(f"{kind} {cls.name!r}: options {old}={value} and "
                                  f"{new}={current[new]} disagree; give only {new!r}")
        warnings.warn(f"{kind} {cls.name!r} option {old!r} is deprecated; use {new!r}",
                      DeprecationWarning, stacklevel=2)
        current[new] = value
    return current


def build(cls: type, options: Optional[Mapping[str, str]], kind: str) -> Any:
    """An instance of `cls` with its dataclass fields set from text `options`.

    Old option names (`cls.renamed_options`) set their knob, with a DeprecationWarning.

    Raises:
      PolicyLoadError: an option names no field, or has a value of the wrong type,
        or the constructor refuses it (the message names the plugin and option).
    """
    options = current_options(cls, options, kind)
    kwargs: dict[str, Any] = {}
    if options:
        if not dataclasses.is_dataclass(cls):
            raise PolicyLoadError(f"{kind} {cls.name!r} has no options (it is not a dataclass), "
                                  f"got {sorted(options)}")
        hints = typing.get_type_hints(cls)
        settable = {f.name for f in dataclasses.fields(cls) if f.init}
        for key, value in options.items():
            if key not in settable:
                raise PolicyLoadError(f"{kind} {cls.name!r} has no option {key!r}; "
                                      f"options: {', '.join(sorted(settable)) or '(none)'}")
            kwargs[key] = _convert(value, hints[key], f"{kind} {cls.name!r} option {key!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise PolicyLoadError(f"{kind} {cls.name!r}: {e}") from e


def parse_options(text: str) -> dict[str, str]:
    """Parses `key=value,key=value` (the `--policy_opts` syntax)."""
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PolicyLoadError(f"option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    return options


def _knob_docs(doc: str) -> dict[str, str]:
    """Each entry of a Google-style docstring's `Attributes:` and `Args:` sections."""
    docs: dict[str, str] = {}
    indent: Optional[int] = None  # the entries' indentation, inside a section
    current = None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Attributes:", "Args:"):
            indent, current = -1, None
            continue
        if indent is None or not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the next section or paragraph
            indent, current = None, None
            continue
        entry = re.match(r"(\w+)(?: \([^)]*\))?:\s*(.*)", stripped)
        if entry and (indent == -1 or depth <= indent):
            indent, current = depth, entry.group(1)
            docs[current] = entry.group(2)
        elif current is not None and depth > indent:
            docs[current] += " " + stripped
    return docs


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def describe(cls: type, kind: str, flag: Optional[str] = None) -> str:
    """A plugin's knobs for the terminal: each init field's type, default and doc.

    The docs come from the class docstring's `Attributes:` or `Args:` section (Google
    style), as the built-ins write them (a base class's where the class has none).
    `flag` names the options flag (default `--{kind}_opts`).
    """
    doc = inspect.getdoc(cls) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ") if cls.__doc__ else ""
    lines = [f"{kind} {cls.name!r} ({cls.__module__}.{cls.__qualname__})"
             + (f": {summary}" if summary else "")]
    if not dataclasses.is_dataclass(cls):
        return "\n".join(lines + ["no knobs (not a dataclass)"])
    knobs = [f for f in dataclasses.fields(cls) if f.init]
    if not knobs:
        return "\n".join(lines + ["no knobs"])
    hints = typing.get_type_hints(cls)
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docs over its bases'
        docs.update(_knob_docs(inspect.getdoc(klass) or "") if klass.__doc__ else {})
    lines.append(f"knobs (--{flag or kind + '_opts'}=key=value,...):")
    for f in knobs:
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        lines.append(f"  {f.name}: {_type_name(hints.get(f.name, f.type))} = {default}")
        if docs.get(f.name):
            lines.extend(textwrap.wrap(docs[f.name], 96, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6))
    return "\n".join(lines)


def resolve_cache_policy_class(spec: str) -> type:
    """The KV tiers' cache policy class for a registered name, `module:Class` or
    `file.py:Class` (`orca_jax.core.kv.cache_policies`).

    Raises:
      PolicyLoadError: the spec does not resolve to a `CachePolicy` subclass.
    """
    from orca_jax.core.kv.cache_policies import CachePolicy, cache_policy_registry
    return resolve_class(spec, kind="cache policy", plural="cache policies",
                         registry=cache_policy_registry(), base=CachePolicy)


def resolve_cache_policy(spec: str) -> str:
    """The registered name of the cache policy `spec`: a plugin loaded by path is
    registered under the spec as written, so a `KVConfig` names it by text."""
    from orca_jax.core.kv.cache_policies import cache_policy_registry, register_cache_policy
    registry = cache_policy_registry()
    if spec in registry:
        return spec
    cls = resolve_cache_policy_class(spec)
    if registry.get(cls.name) is cls:
        return cls.name
    register_cache_policy(spec)(cls)
    return spec
