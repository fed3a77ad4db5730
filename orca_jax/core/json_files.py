"""Results as JSON: one conversion of numpy values, one atomic writer of files.

Every results file (a run's summary.json and config.json, its requests.jsonl
and steps.jsonl, a sweep's sweep.json, a cost fit, the experiments' tables) is
written through here, so each is valid JSON (no NaN) and a reader never sees
half of one: the text goes to a temporary file in the same folder, is flushed
and fsynced, then renamed over the target (a rename within a file system is
atomic).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Union

import numpy as np


def to_json_value(value: object) -> object:
    """`value` with numpy values made plain Python, and NaN and inf made None.

    Numpy integers become `int`, numpy booleans `bool`, floats (numpy or not)
    `float`, or None when not finite (JSON has no NaN, and an undefined metric
    reads back as null); arrays and tuples become lists. Mappings and sequences
    are converted element by element. Anything else (str, int, bool, None, or an
    object JSON cannot hold, which the writer then rejects naming its type) is
    returned as is.
    """
    kind = type(value)
    if kind is str or kind is int or value is None:  # the common case, first: rows are many
        return value
    if kind is float:
        return value if math.isfinite(value) else None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_json_value(value.tolist())
    return value


def write_json_atomic(path: Union[str, os.PathLike], obj: object, *, sort_keys: bool = True,
                      fsync: bool = True) -> None:
    """Writes `obj` as indented JSON (and a final newline) to `path`, atomically.

    Args:
      path: the file to write (replaced whole if it exists).
      obj: JSON values (see `to_json_value`).
      sort_keys: write each object's keys sorted (a results file that is diffed
        or fingerprinted), or in insertion order (a table that reads top down).
      fsync: make the file durable before it replaces the old one (a crash then
        leaves the old file or the new one, never an empty one).
    """
    _replace_atomic(Path(path), [json.dumps(obj, indent=2, sort_keys=sort_keys), "\n"], fsync)


def write_jsonl_atomic(path: Union[str, os.PathLike], rows: Iterable[object]) -> None:
    """Writes one JSON object per line (keys in insertion order) to `path`, atomically.

    Args:
      path: the file to write (replaced whole if it exists).
      rows: JSON values (see `to_json_value`), one per line.
    """
    write_lines_atomic(path, (json.dumps(row) for row in rows))


def write_lines_atomic(path: Union[str, os.PathLike], lines: Iterable[str]) -> None:
    """Writes `lines` (each one JSON text, without its newline) to `path`, atomically: a
    JSON Lines file whose lines were encoded already."""
    _replace_atomic(Path(path), (line + "\n" for line in lines), fsync=True)


def write_text_atomic(path: Union[str, os.PathLike], text: str) -> None:
    """Writes `text` to `path`, atomically (a printed table beside the JSON results)."""
    _replace_atomic(Path(path), [text], fsync=True)


def _replace_atomic(path: Path, chunks: Iterable[str], fsync: bool) -> None:
    # Beside the target, so the rename never crosses a file system.
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.writelines(chunks)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
