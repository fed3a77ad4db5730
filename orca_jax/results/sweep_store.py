"""A sweep's results on disk, resumable: one JSON line per finished point.

A sweep runs every policy x rate x seed (and, with variants, under every variant:
a setup of its own, e.g. another router, on the same workload). Each finished
point is appended to `points.jsonl` in the sweep's folder as one line holding its
key (policy, rate, seed, and `variant` when it ran under one), the run's summary,
and where it came from (`session`, the id of the process that ran it, and
`finished_at`). Rerunning the sweep reads the
file and runs only the missing points. A point that raised is stored too, with
its `error` (`Type: message`) and an empty summary; a rerun runs it again, and
its new line then stands for it.

Why a crash cannot break a resume: a line is written with a single
`os.write` of the whole line on a file opened with `O_APPEND`, then
`fsync`ed, so a kill leaves either the whole line or a prefix of it with no
final newline. Loading drops (and truncates away) such a trailing partial line:
its point simply runs again. A malformed line *followed* by others is not a
crash artifact; loading refuses it (`SweepPointsError`), naming the file and line.

The workload a sweep ran on is fixed in `sweep.json` (the run plumbing except
the swept rate and seed, each policy's spec and options, and under `variants`
each variant's settings that differ from that plumbing). Opening the folder with a
different workload, or with different options for a policy or different settings
for a variant already in it, raises `SweepConfigError` naming the fields that
differ; new policies, variants, rates and seeds may be added to an existing sweep. A `sweep.json`
written by an older version still resumes: settings it lacks count at their
defaults, settings and options it names by their old names are read under the
new ones, and settings the run no longer has are not compared.

One sweep at a time per folder: `SweepLock` holds `sweep.lock` (an exclusive
`flock`, released by the kernel when its process ends however it ends) with
the holder's pid, host and start time; runs and comparisons hold the same kind
of lock (`folder_lock`). A second sweep into the folder is refused with one
line naming the holder; a lock left by a process that is gone is taken over
with a line saying so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from orca_jax.core.json_files import to_json_value, write_json_atomic
from orca_jax.results.folder_lock import FolderLock, FolderLockedError
from orca_jax.results.sweep_errors import SweepConfigError, SweepPointsError

POINTS_FILE = "points.jsonl"
CONFIG_FILE = "sweep.json"
CONFIG_VERSION = 1
LOCK_FILE = "sweep.lock"


class SweepLockedError(SweepConfigError, FolderLockedError):
    """Another sweep (or run, or comparison) is writing into the same folder."""


class SweepLock(FolderLock):
    """The lock of a sweep folder, `sweep.lock` inside it (`folder_lock.FolderLock`): one
    sweep at a time writes into it; a clean end leaves the file empty.

    Args:
      out_dir: the sweep's folder (created if missing, once the lock is taken).
    """

    locked_error = SweepLockedError

    def __init__(self, out_dir: os.PathLike | str) -> None:
        super().__init__(out_dir, Path(out_dir) / LOCK_FILE, "sweep")


class PointKey(NamedTuple):
    """One point of the sweep grid."""

    policy: str  # the policy's label in the sweep
    rate: float  # requests per second
    seed: int
    variant: Optional[str] = None  # the variant's label; None: the sweep's own setup

    @property
    def label(self) -> str:
        """The curve's name: the policy's label, and `@VARIANT` under a variant."""
        return curve_label(self.policy, self.variant)


def curve_label(policy: str, variant: Optional[str]) -> str:
    """A curve's name: `POLICY`, or `POLICY@VARIANT` (as compare names its rows)."""
    return policy if variant is None else f"{policy}@{variant}"


def _canonical(obj: Any) -> Any:
    """The JSON value of `obj` as it reads back (tuples become lists, and so on)."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _differences(stored: Any, requested: Any, where: str) -> list[str]:
    if isinstance(stored, dict) and isinstance(requested, dict):
        found = []
        for key in sorted(set(stored) | set(requested)):
            found += _differences(stored.get(key), requested.get(key), f"{where}.{key}")
        return found
    return [] if stored == requested else [f"{where}: stored {stored!r}, now {requested!r}"]


class SweepStore:
    """The results folder of one sweep.

    Args:
      out_dir: the sweep's folder (created if missing).
      run_config: the workload and engine plumbing shared by every point (JSON
        values; the swept rate and seed left out).
      policies: label -> {"spec": ..., "options": {...}} of the policies run now.
      run_defaults: the default of each `run_config` setting. A stored sweep that
        lacks a setting (recorded before it existed) ran with its default, so it
        still resumes when the setting is left at that default.
      renamed_settings: old name -> new name of `run_config` settings, to read a
        stored sweep that names them the old way. A stored setting that is not in
        `run_config` at all (one the other engine reads) is not compared.
      renamed_options: label -> {old name: new name} of a policy's options.
      variants: label -> the settings (as in `run_config`) in which a variant differs
        from `run_config`, of the variants run now (None or empty: none; sweep.json
        then has no `variants`).

    Raises:
      SweepConfigError: the folder holds a sweep of another `run_config`, a policy
        label already in it with another spec or options, or a variant label already
        in it with other settings.
    """

    def __init__(self, out_dir: os.PathLike | str, run_config: Mapping[str, Any],
                 policies: Mapping[str, Mapping[str, Any]],
                 run_defaults: Optional[Mapping[str, Any]] = None, *,
                 renamed_settings: Optional[Mapping[str, str]] = None,
                 renamed_options: Optional[Mapping[str, Mapping[str, str]]] = None,
                 variants: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.points_path = self.out_dir / POINTS_FILE
        self.config_path = self.out_dir / CONFIG_FILE
        self.session = uuid.uuid4().hex[:12]  # which process ran a point (resume tests read it)
        self._run_defaults = _canonical(dict(run_defaults or {}))
        self._renamed_settings = dict(renamed_settings or {})
        self._renamed_options = {label: dict(names)
                                 for label, names in (renamed_options or {}).items()}
        self._check_and_record_config(_canonical(dict(run_config)), _canonical(dict(policies)),
                                      _canonical(dict(variants or {})))

    def _check_and_record_config(self, run: dict[str, Any], policies: dict[str, Any],
                                 variants: dict[str, Any]) -> None:
        if self.config_path.exists():
            try:
                stored = json.loads(self.config_path.read_text())
            except json.JSONDecodeError as e:
                raise SweepConfigError(f"{self.config_path}: not valid JSON ({e}); remove the "
                                       "folder or choose another --out_dir") from None
            stored_run = stored.get("run")
            if isinstance(stored_run, dict):
                renamed = {self._renamed_settings.get(k, k): v for k, v in stored_run.items()}
                stored_run = {**{k: v for k, v in self._run_defaults.items() if k in run},
                              **{k: v for k, v in renamed.items() if k in run}}
            diffs = _differences(stored_run, run, "run")
            stored_policies = stored.get("policies", {})
            for label, policy in policies.items():
                if label in stored_policies:
                    diffs += _differences(self._current_names(label, stored_policies[label]),
                                          policy, f"policies.{label}")
            stored_variants = stored.get("variants", {})
            for label, settings in variants.items():
                if label in stored_variants:
                    diffs += _differences(stored_variants[label], settings, f"variants.{label}")
            if diffs:
                raise SweepConfigError(
                    f"{self.out_dir} holds a sweep of another configuration ({self.config_path} "
                    f"differs in: {'; '.join(diffs)}). Use another --out_dir, or rerun with the "
                    "stored settings to resume it.")
            merged = {**stored_policies, **policies}
            merged_variants = {**stored_variants, **variants}
        else:
            stored, merged, merged_variants = None, dict(policies), dict(variants)
        if (stored is None or merged != stored_policies
                or merged_variants != stored_variants):
            # A sweep without variants keeps the sweep.json it always had.
            write_json_atomic(self.config_path, {
                "version": CONFIG_VERSION, "run": run, "policies": merged,
                **({"variants": merged_variants} if merged_variants else {})})

    def _current_names(self, label: str, policy: Any) -> Any:
        """A stored policy entry with its options under their names now."""
        names = self._renamed_options.get(label)
        if not (names and isinstance(policy, dict) and isinstance(policy.get("options"), dict)):
            return policy
        return {**policy, "options": {names.get(k, k): v for k, v in policy["options"].items()}}

    # ------------------------------------------------------------- reading
    def load(self) -> list[dict[str, Any]]:
        """Every finished point, in the order written (a repeated key keeps its first line,
        except that a failed point's line, one with `error`, gives way to a later line).

        A trailing line without its newline (a write cut short by a kill) is
        dropped and truncated from the file, so the next append starts clean.

        Raises:
          SweepPointsError: a malformed line that is not the file's last, naming file and
            line.
        """
        if not self.points_path.exists():
            return []
        data = self.points_path.read_bytes()
        complete_end = data.rfind(b"\n") + 1  # bytes up to the last newline
        if complete_end < len(data):
            with open(self.points_path, "r+b") as f:
                f.truncate(complete_end)
                f.flush()
                os.fsync(f.fileno())
            data = data[:complete_end]
        points: list[dict[str, Any]] = []
        seen: dict[PointKey, int] = {}  # key -> its index in points
        for number, line in enumerate(data.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                point = json.loads(line)
                key = point_key(point)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError,
                    UnicodeDecodeError) as e:
                raise SweepPointsError(
                    f"{self.points_path}:{number}: not a sweep point ({type(e).__name__}: "
                    f"{e}); remove that line (its point runs again) or use another "
                    "--out_dir") from None
            if key not in seen:
                seen[key] = len(points)
                points.append(point)
            elif points[seen[key]].get("error"):  # a failed point, since rerun: the rerun counts
                points[seen[key]] = point
        return points

    def finished_keys(self) -> set[PointKey]:
        """The keys of the points already in the store that did not fail."""
        return {point_key(p) for p in self.load() if not p.get("error")}

    # ------------------------------------------------------------- writing
    def append(self, key: PointKey, summary: Mapping[str, Any],
               extra: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Appends one finished point durably (single write, then fsync).

        Args:
          key: the point.
          summary: the run's summary (JSON values).
          extra: more fields for the line (e.g. `wall_s`, `run_dir`).

        Returns:
          The line's content.
        """
        point = {"policy": key.policy, "rate": float(key.rate), "seed": int(key.seed),
                 # Only under a variant: a sweep without them writes the lines it always did.
                 **({} if key.variant is None else {"variant": key.variant}),
                 "session": self.session, "finished_at": time.time(), **(extra or {}),
                 "summary": to_json_value(summary)}
        line = (json.dumps(point, sort_keys=True) + "\n").encode()
        fd = os.open(self.points_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write on a regular file: disk full
                raise OSError(f"{self.points_path}: wrote {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
        return point


def point_key(point: Mapping[str, Any]) -> PointKey:
    """The key of a loaded point (its `variant` None when the line has none)."""
    variant = point.get("variant")
    return PointKey(str(point["policy"]), float(point["rate"]), int(point["seed"]),
                    None if variant is None else str(variant))


def grid(policies: Sequence[str], rates: Sequence[float],
         seeds: Sequence[int]) -> list[PointKey]:
    """Every point, policy-major then rate then seed (the order a sweep runs them)."""
    return [PointKey(p, float(r), int(s)) for p in policies for r in rates for s in seeds]


@dataclasses.dataclass(frozen=True)
class Curve:
    """One policy's points over rates (under one variant), aggregated over seeds (a plotted
    curve)."""

    policy: str
    rates: np.ndarray  # [R] rates with at least one finished seed, ascending
    x_mean: np.ndarray  # [R] throughput, mean over seeds
    y_mean: np.ndarray  # [R] metric, mean over seeds
    y_low: np.ndarray  # [R] band's lower edge over seeds
    y_high: np.ndarray  # [R] band's upper edge over seeds
    num_seeds: np.ndarray  # [R] seeds with a value at each rate
    variant: Optional[str] = None  # the variant's label; None: the sweep's own setup

    @property
    def label(self) -> str:
        """The curve's name (its legend entry): `POLICY`, or `POLICY@VARIANT`."""
        return curve_label(self.policy, self.variant)


def aggregate(points: Iterable[Mapping[str, Any]], keys: Iterable[PointKey], x_field: str,
              y_field: str, band: str = "minmax") -> list[Curve]:
    """Curves of `y_field` against `x_field` per policy (and variant), mean over seeds with
    a band.

    Args:
      points: loaded points (`SweepStore.load()`).
      keys: the grid to draw (points outside it are ignored).
      x_field, y_field: summary fields (e.g. `throughput_req_s`, `ttft_p99_s`).
      band: `minmax` (lowest to highest seed) or `std` (mean ± one standard deviation).

    Returns:
      One curve per (policy, variant), in the order they first appear in `keys`.
      A point whose summary lacks either value (nothing finished) is skipped.
    """
    if band not in ("minmax", "std"):
        raise ValueError(f"band must be 'minmax' or 'std', got {band!r}")
    wanted = list(keys)
    by_key = {point_key(p): p["summary"] for p in points}
    order = list(dict.fromkeys((k.policy, k.variant) for k in wanted))
    curves = []
    for policy, variant in order:
        ours = [k for k in wanted if (k.policy, k.variant) == (policy, variant)]
        rates = sorted({k.rate for k in ours})
        rows = []
        for rate in rates:
            values = [(by_key[k].get(x_field), by_key[k].get(y_field)) for k in ours
                      if k.rate == rate and k in by_key]
            values = [(x, y) for x, y in values if x is not None and y is not None]
            if not values:
                continue
            xs, ys = np.asarray(values, dtype=np.float64).T  # [num_seeds] each
            if band == "minmax":
                low, high = ys.min(), ys.max()
            else:
                low, high = ys.mean() - ys.std(), ys.mean() + ys.std()
            rows.append((rate, xs.mean(), ys.mean(), low, high, len(ys)))
        table = np.asarray(rows, dtype=np.float64).reshape(-1, 6)  # [R, 6]
        curves.append(Curve(policy=policy, rates=table[:, 0], x_mean=table[:, 1],
                            y_mean=table[:, 2], y_low=table[:, 3], y_high=table[:, 4],
                            num_seeds=table[:, 5].astype(np.int64), variant=variant))
    return curves
