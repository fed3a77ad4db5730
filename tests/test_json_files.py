"""The one numpy-to-JSON conversion and the atomic writers every results file goes through."""

import json
import math
import os

import numpy as np
import pytest

from orca_jax.core import json_files
from orca_jax.core.json_files import to_json_value, write_json_atomic, write_jsonl_atomic


def test_to_json_value_makes_numpy_plain_and_undefined_numbers_null():
    value = to_json_value({"n": np.int64(3), "x": np.float32(0.5), "ok": np.bool_(True),
                           "nan": math.nan, "inf": np.float64(np.inf), "id": "a",
                           "nested": [{"t": (np.int32(1), np.nan)}],
                           "array": np.array([[1.5, np.nan]])})
    assert value == {"n": 3, "x": 0.5, "ok": True, "nan": None, "inf": None, "id": "a",
                     "nested": [{"t": [1, None]}], "array": [[1.5, None]]}
    assert type(value["n"]) is int and type(value["x"]) is float and type(value["ok"]) is bool
    # Valid JSON: a strict reader (no NaN) takes it.
    json.loads(json.dumps(value, allow_nan=False))


def test_write_json_atomic_formats_and_replaces_whole(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    write_json_atomic(path, {"b": 2, "a": 0}, sort_keys=False, fsync=False)
    assert path.read_text() == '{\n  "b": 2,\n  "a": 0\n}\n'
    write_jsonl_atomic(tmp_path / "rows.jsonl", ({"i": i, "x": 0.5} for i in range(2)))
    assert (tmp_path / "rows.jsonl").read_text() == '{"i": 0, "x": 0.5}\n{"i": 1, "x": 0.5}\n'
    assert sorted(os.listdir(tmp_path)) == ["rows.jsonl", "summary.json"]  # no temporary left


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sweep.json"
    write_json_atomic(path, {"version": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic(path, {"version": object()})
    monkeypatch.setattr(json_files.os, "replace", _fail)
    with pytest.raises(OSError, match="disk"):
        write_jsonl_atomic(path, [{"version": 2}])
    assert json.loads(path.read_text()) == {"version": 1}
    assert os.listdir(tmp_path) == ["sweep.json"]


def _fail(*args: object) -> None:
    raise OSError("disk full")
