"""The profiled clock's stored tables: timed once per machine and setup, reused after.

Each process used to time the profiled clock's grid anew at warm-up, so two
commands on one machine priced the same step differently whenever the machine's
load differed between them (the README's main job: 1,585 tok/s idle, 954 under
load). Like JAX's compile cache (`orca_jax.model.compile_cache`), a folder in the
user's cache now keeps what was measured, one file per key:

    $XDG_CACHE_HOME/orca_jax/profiled_clock/<key digest>.json   (~/.cache/... without it)

The key (`table_key`) is everything that changes a step's time: the machine
(`describe_machine`: backend, device kind and count, CPU model and count, jax's
version and XLA's flags), what the engine runs (the model's shapes, dtype,
attention op, tp and pipeline stages, page geometry, the warmed buckets, the
compiled step's variant) and how it was timed (`TIMING_METHOD`, and a digest of
the grid's compositions, so a changed grid is a new key by itself). A later
command with the same key reads the table and times nothing: its steps cost
what the first command's did, whatever the load is now. `--profile_table=fresh`
measures again and replaces the stored table.

The folder is a process setting, as the compile cache's is: a command enables
it (`--profile_store`, default `default_dir()`; `none` keeps nothing); a library
caller that never calls `enable` gets no store, and each profiled clock times its
own grid, as before. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from orca_jax.core.json_files import to_json_value
from orca_jax.sim.calibration import load_fit, save_fit
from orca_jax.sim.cost_model import LinearStepTime

DISABLED = "none"
# How a table's seconds were taken. A change to the statistic, the repeats or the fit makes
# a new key (the grid's own compositions are in the key by digest).
TIMING_METHOD = "profiled_clock/2: 1 untimed + {repeats} timed passes, min, fit_linear"

_log = logging.getLogger(__name__)
_folder: Optional[Path] = None  # the process's store folder (`enable`); None: no store


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/orca_jax/profiled_clock`, `~/.cache/...` without it: beside the
    compile cache's `orca_jax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orca_jax" / "profiled_clock"


def enable(where: Optional[str]) -> Optional[Path]:
    """Points this process's profiled clocks at a store folder, or at none.

    Args:
      where: a folder (created if missing), None or "" for `default_dir()`, or
        "none" for no store (each clock measures its own table).

    Returns:
      The folder, or None when disabled.

    Raises:
      ValueError: one line naming the folder, when it cannot be created (the
        setting is then unchanged).
    """
    global _folder
    if where == DISABLED:
        _folder = None
        return None
    folder = Path(where).expanduser() if where else default_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--profile_store={folder}: cannot create the folder "
                         f"({e.strerror or e})") from e
    _folder = folder
    return folder


def current() -> Optional[ProfileStore]:
    """The store `enable` set for this process, or None."""
    return ProfileStore(_folder) if _folder is not None else None


def describe_machine(backend: str, device_kinds: Sequence[str], jax_version: str
                     ) -> dict[str, Any]:
    """What a step's time depends on of this machine, as a table key's part.

    Args:
      backend: jax's default backend (`cpu`, `gpu`, `tpu`).
      device_kinds: the kind of each device jax sees (`jax.devices()`).
      jax_version: `jax.__version__`.

    Returns:
      The backend, device kind and count, CPU model and count, jax's version and
      `XLA_FLAGS` (optimisation levels, forced device counts), and `name`: the
      machine in a few words for the terminal.
    """
    cpu = _cpu_model()
    kinds = sorted(set(device_kinds))
    num_cpus = os.cpu_count() or 0
    name = (f"{cpu} ({num_cpus} cores)" if backend == "cpu"
            else f"{len(device_kinds)}x {'/'.join(kinds)}")
    return {"backend": backend, "device_kinds": kinds, "num_devices": len(device_kinds),
            "cpu": cpu, "num_cpus": num_cpus, "jax": jax_version,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "name": name}


def machine_name(setup: Mapping[str, Any]) -> str:
    """The machine a clock's `setup` names (`describe_machine` under `machine`), in a
    few words; `this machine` where it names none."""
    machine = setup.get("machine")
    return str(machine.get("name", "this machine")) if isinstance(machine, Mapping) \
        else "this machine"


def _cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def table_key(identity: Mapping[str, Any], setup: Mapping[str, Any],
              buckets: Sequence[tuple[int, int]], grid: Sequence[Any], num_repeats: int
              ) -> dict[str, Any]:
    """A stored table's key: `identity` (model, dtype, attention, page geometry),
    `setup` (the machine, the step's variant), the warmed `buckets` as `(tokens,
    seqs)`, a digest of the timed `grid` (its compositions) and the timing method."""
    grid_text = json.dumps(to_json_value(list(grid)), separators=(",", ":"))
    return to_json_value({**identity, "setup": dict(setup), "buckets": sorted(buckets),
                          "grid_sha256": hashlib.sha256(grid_text.encode()).hexdigest(),
                          "method": TIMING_METHOD.format(repeats=num_repeats)})


def key_digest(key: Mapping[str, Any]) -> str:
    """The first 16 hex digits of the key's sha256: its file's name."""
    text = json.dumps(to_json_value(dict(key)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """One table of the store, as a run used it (config.json's `profile_table.stored`)."""

    key: str  # `key_digest` of its key
    file: str  # its path in the store
    measured_at: str  # local time it was timed, ISO 8601 to the second
    machine: str  # the machine it was timed on, in a few words
    reused: bool  # read from the store (True) or timed by this process (False)

    def line(self) -> str:
        """The one terminal line that says which table prices this run's steps."""
        when = self.measured_at[:16].replace("T", " ")
        head = f"profiled clock: table {self.key} measured {when} on {self.machine}"
        if self.reused:
            return f"{head}, reused (--profile_table=fresh to re-measure)"
        return f"{head}, stored for later commands in {os.path.dirname(self.file)}"


class ProfileStore:
    """A folder of profiled-clock tables, one `calibration.save_fit` file per key.

    Args:
      folder: the store's folder (created when the first table is saved).
    """

    def __init__(self, folder: os.PathLike[str] | str) -> None:
        self.folder = Path(folder)

    def path_of(self, key: Mapping[str, Any]) -> Path:
        """The file that holds the table of `key`."""
        return self.folder / f"{key_digest(key)}.json"

    def load(self, key: Mapping[str, Any], tokens: Sequence[int]
             ) -> Optional[tuple[dict[int, LinearStepTime], StoredTable]]:
        """The stored table of `key`, or None when there is none to use.

        A file that cannot be read, is no table, or is another key's or other
        buckets' (`tokens`, sorted) is reported in one warning line and None is
        returned: the caller measures again and replaces it.
        """
        path = self.path_of(key)
        if not path.exists():
            return None
        try:
            fit, metadata = load_fit(str(path))
            if metadata.get("key") != to_json_value(dict(key)):
                raise ValueError("its key is another setup's")
            if sorted(fit) != sorted(tokens):
                raise ValueError(f"it has buckets {sorted(fit)}, not {sorted(tokens)}")
            table = StoredTable(key=key_digest(key), file=str(path),
                                measured_at=str(metadata["measured_at"]),
                                machine=str(metadata["machine"]), reused=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            _log.warning("profiled clock: stored table %s is unusable (%s); measuring it again",
                         path, f"missing field {e}" if isinstance(e, KeyError) else e)
            return None
        return fit, table

    def save(self, key: Mapping[str, Any], fit: Mapping[int, LinearStepTime],
             metadata: Mapping[str, Any], machine: str) -> StoredTable:
        """Stores `fit` under `key` (replacing any table there) and says what it stored.

        Args:
          key: the table's key (`table_key`).
          fit: the measured per-bucket table.
          metadata: what the file says besides (the clock's identity).
          machine: the machine it was timed on, in a few words.

        A store that cannot be written is reported in one warning line: the run goes
        on with the table it measured, and the next command measures again.
        """
        path = self.path_of(key)
        measured_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_fit(str(path), fit, metadata={**metadata, "key": to_json_value(dict(key)),
                                               "measured_at": measured_at, "machine": machine})
        except OSError as e:
            _log.warning("profiled clock: cannot store the table in %s (%s)", path,
                         e.strerror or e)
        return StoredTable(key=key_digest(key), file=str(path), measured_at=measured_at,
                           machine=machine, reused=False)
