"""Compiled step executables kept on disk, so a warm run skips tracing and lowering.

JAX's persistent compilation cache (`compile_cache`) is keyed by the lowered
program, so a run must still trace and lower every bucket to find its entry: on
a CPU that is ~0.2 s a bucket, the largest cost left in a warm run of the
README's main job. This cache sits in front of it, keyed by everything the
lowered program is a function of:

- the source of every module the step can run (`orca_jax`, `pallas_kernels`),
- the versions of python, flax, numpy and every jax distribution (jaxlib, the
  CUDA plugins), JAX's configuration and `XLA_FLAGS`,
- the host CPU (model and feature flags: XLA:CPU compiles for them) and the
  devices (platform and its version, kinds, ids),
- the engine's static choices (step function, attention op, model shapes,
  dtype, mesh) and the avals and shardings of the step's arguments.

An entry is the executable as XLA serializes it
(`jax.experimental.serialize_executable`), stored beside JAX's own entries in
the compile cache's folder (`executables/`), so `--compile_cache=none` turns
both off. A key that misses in any part compiles as before; an entry that
cannot be read or loaded is compiled again and overwritten. A step whose
attention is a user's function (code we cannot hash) is never cached. What it
stores is compiled afresh (`compile_cache.bypassed`): an XLA:CPU executable that
JAX loaded from its own cache serializes into an entry that fails when run. The
folder keeps at most `MAX_BYTES`, the least recently used entries going first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import tempfile
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import serialize_executable

import pallas_kernels
from orca_jax.model import compile_cache

__all__ = ["load", "program_key", "store", "usable"]

_log = logging.getLogger(__name__)
_FORMAT = 1  # bump when an entry's layout changes
_FOLDER = "executables"
# Every edit of the source keys new entries, so the folder would only grow: past this
# many bytes the least recently used entries go (a load marks its entry used).
MAX_BYTES = 2 << 30
# Set when this backend cannot serialize an executable: the engine then stops keying and
# storing steps, and its compiles go through JAX's own cache again (`usable`).
_serialize_failed = False


def usable() -> bool:
    """Whether steps are worth keying here: False once serializing one has failed."""
    return not _serialize_failed


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 over the path and bytes of every .py file of orca_jax and pallas_kernels."""
    digest = hashlib.sha256()
    orca_jax_root = Path(__file__).resolve().parents[1]  # this file is orca_jax/model/...
    for root in (orca_jax_root, Path(pallas_kernels.__file__).resolve().parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _host_cpu() -> tuple[str, str]:
    """The host's architecture and CPU model and feature flags (Linux's /proc/cpuinfo):
    XLA:CPU compiles for the features it finds, so an entry made on one machine must not
    load on another (a cache folder on a shared home directory)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()  # the first processor
        described = "\n".join(line for line in lines
                              if line.split(":")[0].strip() in ("model name", "flags"))
    except OSError:  # not Linux: the processor string is what there is
        described = platform.processor()
    return platform.machine(), hashlib.sha256(described.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str]:
    """Versions of the packages that trace and compile the step: flax, numpy, and every
    installed jax distribution (jax, jaxlib, the CUDA plugins, which hold XLA:GPU)."""
    from importlib import metadata

    versions = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("jax") or name in ("flax", "numpy", "ml-dtypes"):
            versions[name] = dist.version
    return dict(sorted(versions.items()))


def _environment() -> dict[str, Any]:
    """What outside the program shapes its lowering and compilation."""
    config = {name: value for name, value in sorted(jax.config.values.items())
              if isinstance(value, (bool, int, float, str, type(None)))
              and "compilation_cache" not in name and "persistent_cache" not in name}
    backend = jax.devices()[0].client
    return {"format": _FORMAT, "python": platform.python_version(), "jax": jax.__version__,
            "numpy": np.__version__, "packages": _package_versions(), "cpu": _host_cpu(),
            "platform_version": backend.platform_version,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_config": config,
            "devices": [(d.platform, d.device_kind, d.id) for d in jax.devices()],
            "source": _source_digest()}


def _avals(tree: Any) -> str:
    """The tree's structure and each leaf's shape, dtype and sharding, as text."""
    leaves, structure = jax.tree.flatten(tree)
    return json.dumps([str(structure), [(tuple(leaf.shape), str(leaf.dtype),
                                         str(getattr(leaf, "sharding", None)))
                                        for leaf in leaves]])


def program_key(static: dict[str, Any], args: tuple[Any, ...]) -> str:
    """The cache key of a compiled step.

    Args:
      static: the engine's choices baked into the trace (names, configs), as
        JSON-serializable values or values whose `repr` says all of them.
      args: the step's arguments (arrays or `jax.ShapeDtypeStruct`s): only
        their structure, avals and shardings enter the key.
    """
    text = json.dumps({"environment": _environment(), "static": static,
                       "args": _avals(args)}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _entry_path(key: str) -> Optional[Path]:
    folder = compile_cache.current_dir()
    return None if folder is None else Path(folder) / _FOLDER / f"{key}.pkl"


def load(key: str) -> Optional[tuple[jax.stages.Compiled, int]]:
    """The executable stored under `key` and the XLA compiles it took, or None (no
    cache, no entry, or an entry that cannot be loaded)."""
    path = _entry_path(key)
    if path is None or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if entry.get("format") != _FORMAT:
            return None
        compiled = serialize_executable.deserialize_and_load(
            entry["executable"], entry["in_tree"], entry["out_tree"])
        os.utime(path)  # used now: the last to be evicted
        return compiled, int(entry["num_compiles"])
    except Exception as error:  # noqa: BLE001 - any unreadable entry is compiled again
        _log.warning("executable cache: %s unreadable (%s: %s); compiling again", path,
                     type(error).__name__, error)
        return None


def store(key: str, compiled: jax.stages.Compiled, num_compiles: int) -> None:
    """Writes `compiled` under `key` (atomically); a cache that cannot take it is skipped."""
    path = _entry_path(key)
    if path is None:
        return
    global _serialize_failed
    try:
        executable, in_tree, out_tree = serialize_executable.serialize(compiled)
    except Exception as error:  # noqa: BLE001 - e.g. a backend that cannot serialize
        _serialize_failed = True
        _log.warning("executable cache: off in this process, this backend's executables "
                     "do not serialize (%s: %s)", type(error).__name__, error)
        return
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            temporary = f.name
            pickle.dump({"format": _FORMAT, "executable": executable, "in_tree": in_tree,
                         "out_tree": out_tree, "num_compiles": num_compiles}, f)
        os.replace(temporary, path)  # readers see the whole entry or none
        _evict(path.parent, keep=path)
    except Exception as error:  # noqa: BLE001 - the run goes on without the entry
        _log.warning("executable cache: cannot store %s (%s: %s)", path,
                     type(error).__name__, error)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


def _evict(folder: Path, keep: Path, max_bytes: Optional[int] = None) -> None:
    """Deletes the least recently used entries of `folder` until it holds at most
    `max_bytes` (`MAX_BYTES` by default), never `keep`."""
    limit = MAX_BYTES if max_bytes is None else max_bytes
    entries = []
    for path in folder.glob("*.pkl"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            total -= size
