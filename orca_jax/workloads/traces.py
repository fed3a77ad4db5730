"""Request traces on disk: load them as `Request`s, save workloads as traces.

Two formats, chosen by the file's extension:

  * JSON Lines (`.jsonl`, `.json`): one object per line; `prompt_tokens` is a
    list of ints.
  * CSV (`.csv`): a header row; `prompt_tokens` is space-separated ints.

Fields (unknown extra fields are ignored, so files with an index column or
derived columns load as they are):

  * `arrival_s` (or Vidur/Splitwise `arrived_at`): seconds, finite, >= 0.
  * `prompt_len` (or `num_prefill_tokens`) and/or `prompt_tokens`; when both
    are given they must agree.
  * `output_len` (or `num_decode_tokens`): integer >= 1.
  * optional `priority` (int), `tenant` (str), `deadline_s` (float, absolute
    seconds), `id` (int; ids default to 0..N-1 in arrival order).

Where a file holds both our name and the Vidur name of a field, ours wins.
Every record is parsed and checked before any `Request` is returned, and every
error is a `TraceError` saying `file:line: field 'name': ...`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.request import Request

PathLike = Union[str, os.PathLike]

# Canonical field name -> every name it may appear under in a file, preferred first.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "arrival_s": ("arrival_s", "arrived_at"),
    "prompt_len": ("prompt_len", "num_prefill_tokens"),
    "output_len": ("output_len", "num_decode_tokens"),
    "prompt_tokens": ("prompt_tokens",),
    "priority": ("priority",),
    "tenant": ("tenant",),
    "deadline_s": ("deadline_s",),
    "id": ("id",),
}

_JSON_SUFFIXES = (".jsonl", ".json")
_CSV_SUFFIXES = (".csv",)
_INT32_MAX = np.iinfo(np.int32).max


class TraceError(ValueError):
    """A trace file that cannot be loaded; the message names file, line and field."""


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        return "jsonl"
    if suffix in _CSV_SUFFIXES:
        return "csv"
    raise TraceError(f"{path}: unsupported trace format {suffix or '(no extension)'!r}; "
                     f"expected a .jsonl/.json (JSON Lines) or .csv file")


def _fail(where: str, name: str, expected: str, got: object) -> TraceError:
    return TraceError(f"{where}: field '{name}': expected {expected}, got {got!r}")


def _is_blank(raw: object) -> bool:
    return raw is None or (isinstance(raw, str) and raw.strip() == "")


def _parse_int(where: str, name: str, raw: object, minimum: Optional[int]) -> int:
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    value: Optional[int] = None
    if isinstance(raw, bool):
        value = None  # JSON true/false are not counts
    elif isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str):
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                as_float = float(text)  # "44.0", as some dataframe writers emit
            except ValueError:
                as_float = math.nan
            value = int(as_float) if as_float.is_integer() else None
    if value is None or (minimum is not None and value < minimum):
        raise _fail(where, name, expected, raw)
    return value


def _parse_float(where: str, name: str, raw: object, minimum: Optional[float]) -> float:
    expected = "a finite number" + ("" if minimum is None else f" >= {minimum:g}")
    value = math.nan
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise _fail(where, name, expected, raw)
    return value


def _parse_tokens(where: str, name: str, raw: object) -> NDArray[np.int32]:
    expected = "a non-empty list of token ids in [0, 2**31)"
    items: list[object]
    if isinstance(raw, list):
        items = raw
    elif isinstance(raw, str):
        items = list(raw.split())
    else:
        raise _fail(where, name, expected, raw)
    if not items:
        raise _fail(where, name, expected, raw)
    tokens = np.empty(len(items), dtype=np.int32)  # [prompt_len]
    for i, item in enumerate(items):
        try:
            token = _parse_int(where, name, item, 0)
        except TraceError:
            raise _fail(where, name, f"{expected} (item {i})", item) from None
        if token > _INT32_MAX:
            raise _fail(where, name, f"{expected} (item {i})", item)
        tokens[i] = token
    return tokens


def _missing(where: str, canonical: str) -> TraceError:
    names = " or ".join(f"'{n}'" for n in FIELD_ALIASES[canonical])
    return TraceError(f"{where}: field '{canonical}': missing (expected a column/key {names})")


def _parse_record(record: dict, where: str) -> tuple[Optional[int], dict[str, object]]:
    """Parses one record into (explicit id or None, Request keyword arguments without id)."""

    def lookup(canonical: str) -> Optional[tuple[str, object]]:
        for name in FIELD_ALIASES[canonical]:
            if name in record:
                return name, record[name]
        return None

    kwargs: dict[str, object] = {}
    found = lookup("arrival_s")
    if found is None or _is_blank(found[1]):
        raise _missing(where, "arrival_s")
    kwargs["arrival_s"] = _parse_float(where, found[0], found[1], 0.0)

    tokens = None
    found = lookup("prompt_tokens")
    if found is not None and not _is_blank(found[1]):
        tokens = _parse_tokens(where, found[0], found[1])
    found = lookup("prompt_len")
    if found is not None and not _is_blank(found[1]):
        prompt_len = _parse_int(where, found[0], found[1], 1)
        if tokens is not None and len(tokens) != prompt_len:
            raise _fail(where, "prompt_tokens", f"{prompt_len} token ids ('{found[0]}')",
                        f"{len(tokens)} token ids")
    elif tokens is not None:
        prompt_len = len(tokens)
    else:
        raise TraceError(f"{where}: field 'prompt_len': missing (expected a column/key "
                         f"'prompt_len', 'num_prefill_tokens' or 'prompt_tokens')")
    kwargs["prompt_len"] = prompt_len
    kwargs["prompt_tokens"] = tokens

    found = lookup("output_len")
    if found is None or _is_blank(found[1]):
        raise _missing(where, "output_len")
    kwargs["output_len"] = _parse_int(where, found[0], found[1], 1)

    found = lookup("priority")
    if found is not None and not _is_blank(found[1]):
        kwargs["priority"] = _parse_int(where, found[0], found[1], None)
    found = lookup("tenant")
    if found is not None and not _is_blank(found[1]):
        if not isinstance(found[1], str):
            raise _fail(where, found[0], "a string", found[1])
        kwargs["tenant"] = found[1]
    found = lookup("deadline_s")
    if found is not None and not _is_blank(found[1]):
        kwargs["deadline_s"] = _parse_float(where, found[0], found[1], None)
    explicit_id = None
    found = lookup("id")
    if found is not None and not _is_blank(found[1]):
        explicit_id = _parse_int(where, found[0], found[1], None)
    return explicit_id, kwargs


def _csv_records(path: Path) -> tuple[list[str], list[tuple[str, dict]]]:
    """Returns the header and (where, {column: cell}) per data row of a CSV file."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file; expected a header row")
        names = [name.strip() for name in header]
        records = []
        for row in reader:
            if not row or all(cell.strip() == "" for cell in row):
                continue
            # A short row lacks its last keys, which then read as missing fields.
            records.append((f"{path}:{reader.line_num}", dict(zip(names, row))))
    return names, records


def _check_trace_header(path: Path, names: list[str]) -> None:
    """Fails on line 1 for a CSV whose columns cannot make requests."""

    def has(canonical: str) -> bool:
        return any(name in names for name in FIELD_ALIASES[canonical])

    if not has("arrival_s"):
        hint = ""
        if has("prompt_len") and has("output_len"):
            hint = (f"; this file has lengths only: use it as an empirical length "
                    f"distribution, e.g. --prompt_len=empirical:{path}")
        raise TraceError(f"{path}:1: field 'arrival_s': no arrival-time column "
                         f"(expected 'arrival_s' or 'arrived_at'){hint}")
    if not has("output_len"):
        raise _missing(f"{path}:1", "output_len")
    if not (has("prompt_len") or has("prompt_tokens")):
        raise TraceError(f"{path}:1: field 'prompt_len': missing (expected a column "
                         f"'prompt_len', 'num_prefill_tokens' or 'prompt_tokens')")


def _jsonl_objects(path: Path) -> list[tuple[str, dict]]:
    """Returns (where, object) per record of a JSON Lines file."""
    records = []
    with open(path, encoding="utf-8-sig") as f:
        for line_num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_num}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                 f"expected one JSON object per line") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object per line, "
                                 f"got {type(obj).__name__}")
            records.append((where, obj))
    return records


def load_trace(path: PathLike, *, time_scale: float = 1.0,
               max_requests: Optional[int] = None) -> list[Request]:
    """Loads a request trace (JSON Lines or CSV) as requests in arrival order.

    Args:
      path: a `.jsonl`/`.json` or `.csv` file (see the module docstring for fields).
      time_scale: multiplies every arrival time and deadline; 0.5 replays the
        trace at twice its request rate.
      max_requests: keep only the first this many requests in arrival order.

    Returns:
      The requests sorted by arrival time (ties keep file order). Ids are the
      file's `id` values if it has them, else 0..N-1 in arrival order.

    Raises:
      TraceError: the file is unreadable as a trace; the message names the
        file, the 1-based line and the field.
    """
    path = Path(path)
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"load_trace({path}): time_scale must be a finite number > 0, "
                         f"got {time_scale!r}")
    if max_requests is not None and (int(max_requests) != max_requests or max_requests < 1):
        raise ValueError(f"load_trace({path}): max_requests must be an integer >= 1, "
                         f"got {max_requests!r}")
    fmt = _file_format(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    if fmt == "csv":
        names, records = _csv_records(path)
        _check_trace_header(path, names)
    else:
        records = _jsonl_objects(path)
    if not records:
        raise TraceError(f"{path}: the trace holds no requests")

    parsed = []
    first_line_of_id: dict[int, str] = {}
    for where, record in records:
        explicit_id, kwargs = _parse_record(record, where)
        if explicit_id is not None:
            if explicit_id in first_line_of_id:
                raise _fail(where, "id", f"a unique id (also on {first_line_of_id[explicit_id]})",
                            explicit_id)
            first_line_of_id[explicit_id] = where
        parsed.append((explicit_id, kwargs))
    if first_line_of_id and len(first_line_of_id) != len(parsed):
        missing_at = next(w for (w, _), (i, _) in zip(records, parsed) if i is None)
        raise TraceError(f"{missing_at}: field 'id': missing, but other records have ids "
                         f"(give every record an id, or none)")

    # sorted() is stable, so equal arrival times keep file order.
    order = sorted(range(len(parsed)), key=lambda i: parsed[i][1]["arrival_s"])
    if max_requests is not None:
        order = order[:max_requests]
    requests = []
    for rank, i in enumerate(order):
        explicit_id, kwargs = parsed[i]
        kwargs = dict(kwargs)
        kwargs["arrival_s"] = kwargs["arrival_s"] * time_scale
        if "deadline_s" in kwargs:
            kwargs["deadline_s"] = kwargs["deadline_s"] * time_scale
        requests.append(Request(id=rank if explicit_id is None else explicit_id, **kwargs))
    return requests


def load_length_column(path: PathLike, column: str) -> NDArray[np.int64]:
    """Reads one integer column (every value >= 1) of a CSV or JSON Lines file.

    Used for empirical length distributions: arrival times are not needed.

    Args:
      path: a `.csv` or `.jsonl`/`.json` file.
      column: a column/key name; our names (`prompt_len`, `output_len`) also
        find their Vidur twins (`num_prefill_tokens`, `num_decode_tokens`).

    Returns:
      `[num_rows]` int64 values in file order.

    Raises:
      TraceError: missing file or column, or a value that is not an integer >= 1.
    """
    path = Path(path)
    fmt = _file_format(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    aliases = FIELD_ALIASES.get(column, (column,))
    if fmt == "csv":
        header, records = _csv_records(path)
        if not any(name in header for name in aliases):
            raise TraceError(f"{path}:1: field '{column}': no such column "
                             f"(the header has {', '.join(header) or 'nothing'})")
    else:
        records = _jsonl_objects(path)
    values: list[int] = []
    for where, record in records:
        name = next((n for n in aliases if n in record), None)
        if name is None:
            raise TraceError(f"{where}: field '{column}': missing")
        values.append(_parse_int(where, name, record[name], 1))
    if not values:
        raise TraceError(f"{path}: field '{column}': the file holds no values")
    return np.asarray(values, dtype=np.int64)


def write_trace(path: PathLike, requests: Sequence[Request]) -> None:
    """Writes requests as a JSON Lines trace that `load_trace` reads back identically.

    Args:
      path: the `.jsonl` (or `.json`) file to write; replaced if it exists.
      requests: the requests, written in the given order with all their fields.
    """
    path = Path(path)
    if _file_format(path) != "jsonl":
        raise TraceError(f"{path}: write_trace writes JSON Lines; give a .jsonl path")
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record: dict[str, object] = {
                "id": int(r.id),
                "arrival_s": float(r.arrival_s),  # repr of a float round-trips exactly
                "prompt_len": int(r.prompt_len),
                "output_len": int(r.output_len),
                "priority": int(r.priority),
                "tenant": r.tenant,
            }
            if r.deadline_s is not None:
                record["deadline_s"] = float(r.deadline_s)
            if r.prompt_tokens is not None:
                record["prompt_tokens"] = r.prompt_tokens.tolist()
            f.write(json.dumps(record) + "\n")
