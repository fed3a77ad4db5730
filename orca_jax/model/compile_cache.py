"""JAX's persistent compilation cache, in a user cache folder, for the engine's buckets.

Compiling a run's step buckets takes most of a short CPU run; JAX can keep the
compiled executables on disk, keyed by the program, its compile options and the
jax/jaxlib versions, so a second run with the same model and buckets loads
them instead. JAX's defaults skip programs that compile in under a second (every
small CPU step), so `enable` lowers both thresholds. The cache is a process
setting, not part of a run's spec: a cached executable is the same program, so
compile counts (a cache hit counts as a compile, see `engine.backend_compiles`)
and HLO fingerprints do not change. The engine's steps go one further: the same
folder holds them whole (`executable_cache`), so a warm run does not even trace
and lower them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache

DISABLED = "none"


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/orca_jax/jax`, `~/.cache/orca_jax/jax` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orca_jax" / "jax"


def enable(where: Optional[str]) -> Optional[Path]:
    """Points JAX's persistent compilation cache at `where`, or turns it off.

    Args:
      where: a folder (created if missing), None or "" for `default_dir()`, or
        "none" to disable the cache.

    Returns:
      The cache folder, or None when disabled.

    Raises:
      ValueError: one line naming the folder, when it cannot be created.
    """
    if where == DISABLED:
        jax.config.update("jax_compilation_cache_dir", None)
        _reset()
        return None
    folder = Path(where).expanduser() if where else default_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile_cache={folder}: cannot create the folder "
                         f"({e.strerror or e})") from e
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # Cache every program: a small CPU step compiles in well under JAX's 1 s default.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _reset()  # a cache checked before now would stay off
    return folder


def _reset() -> None:
    """JAX's `reset_cache`, without its INFO line (a bad-flag error stays one line)."""
    jax_logger = logging.getLogger("jax._src.compilation_cache")
    level = jax_logger.level
    jax_logger.setLevel(logging.WARNING)
    try:
        compilation_cache.reset_cache()
    finally:
        jax_logger.setLevel(level)


def current_dir() -> Optional[str]:
    """The cache folder JAX writes to now, or None."""
    return jax.config.jax_compilation_cache_dir


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Compiles inside skip JAX's persistent cache (neither read nor written there).

    For `executable_cache`: an executable XLA:CPU loaded from JAX's cache serializes
    into an entry that fails when run ("Function ... not found"), so the programs it
    stores are compiled afresh.
    """
    folder = current_dir()
    if folder is None:
        yield
        return
    jax.config.update("jax_compilation_cache_dir", None)
    _reset()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", folder)
        _reset()
