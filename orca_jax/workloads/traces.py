"""Request traces on disk: load them as `Request`s, save workloads as traces.

Two formats, chosen by the file's extension:

  * JSON Lines (`.jsonl`, `.json`): one object per line; `prompt_tokens` is a
    list of ints.
  * CSV (`.csv`): a header row; `prompt_tokens` is space-separated ints. A row
    with a (non-empty) cell past the header's columns is an error: no column
    says which field it is.

Fields (unknown extra fields are ignored, so files with an index column or
derived columns load as they are; docs/traces.md has them with examples):

  * `arrival_s` (or Vidur/Splitwise `arrived_at`): seconds, finite, >= 0; or
    Mooncake's `timestamp`, in milliseconds. A file with no arrival times at all
    is an offline batch: every request arrives at 0, in file order. A file where
    some records have one and others not is an error.
  * `prompt_len` (or `num_prefill_tokens`, Mooncake's `input_length`) and/or
    either `prompt_tokens` or Mooncake's `hash_ids` (the prompt's blocks as ids,
    `hashed_blocks`); when both are given they must agree. A record with
    `hash_ids` gets the token ids its blocks stand for, in a vocabulary the
    caller gives. Blocks are `block_size` tokens (a field, or the caller's
    `block_size`, else Mooncake's 512), the same in every record of a file.
  * `output_len` (or `num_decode_tokens`, Mooncake's `output_length`): integer >= 1.
    A file with no output lengths at all takes them from the caller
    (`output_lens`, the commands' `--output_len`); without that it is an error.
  * optional `priority` (int), `tenant` (str), `deadline_s` (float, absolute
    seconds), `id` (int; ids default to 0..N-1 in arrival order),
    `planned_output_tokens` (the planned answer's ids, `output_len` of them),
    `conversation_id` and `turn` (ints, together).

Where a file holds both our name and another's for a field, ours wins. The
peer vLLM driver's traces (`arrival_s`, `output_len`, `prompt_tokens`) load as
they are, and it reads what `write_trace` writes.

Every record is parsed and checked before any `Request` is returned, and every
error is a `TraceError` saying `file:line: field 'name': ...`.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request
from orca_jax.workloads.hashed_blocks import block_tokens, cached_prefix_lens
from orca_jax.workloads.trace_records import (
    FIELD_ALIASES,
    MAX_LENGTH,
    TraceError,
    field_error,
    missing_field,
    parse_int,
    parse_record,
)

PathLike = Union[str, os.PathLike]

_JSON_SUFFIXES = (".jsonl", ".json")
_CSV_SUFFIXES = (".csv",)


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        return "jsonl"
    if suffix in _CSV_SUFFIXES:
        return "csv"
    raise TraceError(f"{path}: unsupported trace format {suffix or '(no extension)'!r}; "
                     f"expected a .jsonl/.json (JSON Lines) or .csv file")


def _read_text(path: Path) -> str:
    """The file's text (UTF-8, a byte-order mark skipped); a byte that is not UTF-8 is a
    `TraceError` naming its line and column, not a `UnicodeDecodeError` of some buffer."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        raise TraceError(f"{path}:{line}: byte 0x{data[e.start]:02x} at column "
                         f"{e.start - line_start + 1} is not UTF-8 text; save the trace as "
                         f"UTF-8") from None


def _csv_records(path: Path) -> tuple[list[str], list[tuple[str, dict]]]:
    """Returns the header and (where, {column: cell}) per data row of a CSV file."""
    with io.StringIO(_read_text(path), newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file; expected a header row")
        names = [name.strip() for name in header]
        records = []
        for row in reader:
            if not row or all(cell.strip() == "" for cell in row):
                continue
            # A long row has a cell no column names: which field did it mean? (Empty extra
            # cells, a trailing comma, hold nothing to lose.)
            if any(cell.strip() for cell in row[len(names):]):
                raise TraceError(f"{path}:{reader.line_num}: {len(row)} cells under a header of "
                                 f"{len(names)} columns ({','.join(names)}); cell "
                                 f"{len(names) + 1} ({row[len(names)]!r}) has no column")
            # A short row lacks its last keys, which then read as missing fields.
            records.append((f"{path}:{reader.line_num}", dict(zip(names, row))))
    return names, records


def _check_trace_header(path: Path, names: list[str]) -> None:
    """Fails on line 1 for a CSV whose columns cannot make requests."""

    def has(canonical: str) -> bool:
        return any(name in names for name in FIELD_ALIASES[canonical])

    # No arrival column: an offline batch. No output column: lengths from the caller.
    if not (has("prompt_len") or has("prompt_tokens") or has("hash_ids")):
        raise TraceError(f"{path}:1: field 'prompt_len': missing (expected a column "
                         f"'prompt_len', 'num_prefill_tokens', 'input_length', 'prompt_tokens' "
                         f"or 'hash_ids')")


def _jsonl_objects(path: Path) -> list[tuple[str, dict]]:
    """Returns (where, object) per record of a JSON Lines file."""
    records = []
    with io.StringIO(_read_text(path), newline=None) as f:  # universal newlines, as open()
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


def _all_or_none(parsed: list[tuple[str, Optional[int], dict[str, object]]], key: str,
                 canonical: str, none_means: str) -> bool:
    """Whether every record has `key` (False: none has); a file where only some do is an
    error on the first record without it."""
    has = [key in kwargs for _, _, kwargs in parsed]
    if all(has) or not any(has):
        return all(has)
    first_with = next(where for (where, _, _), h in zip(parsed, has) if h)
    first_without = next(where for (where, _, _), h in zip(parsed, has) if not h)
    raise TraceError(f"{missing_field(first_without, canonical)}, but {first_with} has one "
                     f"(give it in every record, or in none: {none_means})")


# Where the public traces the reproductions default to come from (the project keeps no
# copy): a missing default says where to get it.
PUBLIC_TRACE_SOURCES = {
    "mooncake_conversation_2025.jsonl": "FAST25-release/traces/conversation_trace.jsonl of "
                                        "github.com/kvcache-ai/Mooncake",
    "azure_conv_2023.csv": "data/processed_traces/splitwise_conv.csv of "
                           "github.com/microsoft/vidur",
    "azure_code_2023.csv": "data/processed_traces/splitwise_code.csv of "
                           "github.com/microsoft/vidur",
    "arxiv_summarization_lengths.csv": "data/processed_traces/arxiv_summarization_stats_"
                                       "llama2_tokenizer_filtered_v2.csv of "
                                       "github.com/microsoft/vidur",
}


def _sorted_records(path: Path, max_requests: Optional[int], block_size: Optional[int] = None
                    ) -> list[tuple[str, Optional[int], dict[str, object]]]:
    """Reads and checks every record of a trace file.

    A file without arrival times gets 0.0 for each (an offline batch); one without
    output lengths has no "output_len" in any record (`load_trace` fills them in).

    Returns:
      (where, explicit id or None, Request keyword arguments) of the first
      `max_requests` records in arrival order (ties keep file order).
    """
    fmt = _file_format(path)
    if not path.is_file():
        source = PUBLIC_TRACE_SOURCES.get(path.name)
        raise TraceError(f"{path}: no such trace file"
                         + (f" (it is {source}; point the flag at your copy)" if source else ""))
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
        explicit_id, kwargs = parse_record(record, where, block_size)
        if explicit_id is not None:
            if explicit_id in first_line_of_id:
                raise field_error(where, "id",
                                  f"a unique id (also on {first_line_of_id[explicit_id]})",
                                  explicit_id)
            first_line_of_id[explicit_id] = where
        parsed.append((where, explicit_id, kwargs))
    if first_line_of_id and len(first_line_of_id) != len(parsed):
        missing_at = next(where for where, i, _ in parsed if i is None)
        raise TraceError(f"{missing_at}: field 'id': missing, but other records have ids "
                         f"(give every record an id, or none)")
    if not _all_or_none(parsed, "arrival_s", "arrival_s",
                        "an offline batch, every request at time 0 in file order"):
        for _, _, kwargs in parsed:
            kwargs["arrival_s"] = 0.0
    _all_or_none(parsed, "output_len", "output_len", "lengths from --output_len")
    sizes = [(where, kwargs["block_size"]) for where, _, kwargs in parsed if "block_size" in kwargs]
    other = next(((where, size) for where, size in sizes if size != sizes[0][1]), None)
    if other is not None:
        raise field_error(other[0], "block_size", f"{sizes[0][1]} tokens per block, as on "
                          f"{sizes[0][0]} (one block size per file: the ids of one hash)",
                          other[1])
    # sorted() is stable, so equal arrival times (an offline batch's) keep file order.
    parsed.sort(key=lambda entry: entry[2]["arrival_s"])
    return parsed if max_requests is None else parsed[:max_requests]


def load_trace(path: PathLike, *, time_scale: float = 1.0, max_requests: Optional[int] = None,
               vocab_size: Optional[int] = None, block_size: Optional[int] = None,
               output_lens: Optional[Callable[[int], Sequence[int]]] = None) -> list[Request]:
    """Loads a request trace (JSON Lines or CSV) as requests in arrival order.

    Args:
      path: a `.jsonl`/`.json` or `.csv` file (see the module docstring for fields).
        A file without arrival times is an offline batch: every request at 0.
      time_scale: multiplies every arrival time and deadline; 0.5 replays the
        trace at twice its request rate.
      max_requests: keep only the first this many requests in arrival order.
      vocab_size: the vocabulary that records with `hash_ids` take their token
        ids from ([1, vocab_size)); needed only by such records.
      block_size: tokens per block of `hash_ids` in a file that does not say
        (None: Mooncake's 512); a file whose `block_size` differs is an error.
      output_lens: the output lengths of a file that has none: called once with
        the number of requests kept, it returns that many lengths (each >= 1),
        given to the requests in arrival order. Unused where the file has them.

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
    if vocab_size is not None and (isinstance(vocab_size, bool) or int(vocab_size) != vocab_size
                                   or vocab_size < 2):
        raise ValueError(f"load_trace({path}): vocab_size must be an integer >= 2, "
                         f"got {vocab_size!r}")
    if block_size is not None and (isinstance(block_size, bool) or int(block_size) != block_size
                                   or block_size < 1):
        raise ValueError(f"load_trace({path}): block_size must be an integer >= 1, "
                         f"got {block_size!r}")
    records = _sorted_records(path, max_requests, block_size)
    drawn = None
    if "output_len" not in records[0][2]:  # then no record has one
        if output_lens is None:
            raise TraceError(f"{path}: field 'output_len': in no record (no 'output_len', "
                             f"'num_decode_tokens' or 'output_length'); give the output "
                             f"lengths with --output_len (e.g. --output_len=fixed:128)")
        drawn = [int(n) for n in output_lens(len(records))]
        if len(drawn) != len(records) or min(drawn) < 1:
            raise ValueError(f"load_trace({path}): output_lens({len(records)}) must return "
                             f"{len(records)} lengths >= 1, got {len(drawn)} (least "
                             f"{min(drawn, default=None)})")
    requests = []
    for rank, (where, explicit_id, kwargs) in enumerate(records):
        kwargs = dict(kwargs)
        kwargs["arrival_s"] = kwargs["arrival_s"] * time_scale
        if "deadline_s" in kwargs:
            kwargs["deadline_s"] = kwargs["deadline_s"] * time_scale
        if drawn is not None:
            kwargs["output_len"] = drawn[rank]
        blocks = kwargs.pop("hash_ids", None)
        size = kwargs.pop("block_size", None)
        if blocks is not None:
            # Only the requests kept get tokens: a long trace's prompts hold ~1e8 of them.
            if vocab_size is None:
                raise TraceError(f"{where}: field 'hash_ids': block ids need a vocabulary to "
                                 f"become token ids (load_trace(..., vocab_size=...))")
            kwargs["prompt_tokens"] = block_tokens(blocks, kwargs["prompt_len"], vocab_size,
                                                   size)
        requests.append(Request(id=rank if explicit_id is None else explicit_id, **kwargs))
    return requests


def repeat_trace(requests: Sequence[Request], times: int) -> list[Request]:
    """A trace played `times` times back to back: copy k's arrivals (and deadlines) are
    the trace's shifted by k periods, a period being the last arrival plus the mean gap
    between arrivals (so one copy's last request and the next's first are as far apart
    as two requests on average). Ids become 0..N*times-1 in arrival order.

    Raises:
      ValueError: `times` < 1, or an empty trace.
    """
    if isinstance(times, bool) or int(times) != times or times < 1:
        raise ValueError(f"trace_repeat must be an integer >= 1, got {times!r}")
    if not requests:
        raise ValueError("trace_repeat: the trace has no requests")
    if times == 1:
        return list(requests)
    first, last = requests[0].arrival_s, requests[-1].arrival_s
    gap = (last - first) / (len(requests) - 1) if len(requests) > 1 else 1.0
    period = last + (gap if gap > 0 else 1.0)
    out = []
    for k in range(int(times)):
        shift = k * period
        for r in requests:
            out.append(dataclasses.replace(
                r, id=len(out), arrival_s=r.arrival_s + shift,
                deadline_s=None if r.deadline_s is None else r.deadline_s + shift))
    return out


def prefix_cache_ceiling(path: PathLike, *, page_size: int, max_requests: Optional[int] = None,
                         block_size: Optional[int] = None) -> float:
    """The fraction of a `hash_ids` trace's prompt tokens an unbounded prefix cache holds.

    Computed from the block ids alone (no token ids are made): each request, in
    arrival order, hits its leading blocks seen in any earlier request, in whole
    pages and never its last prompt token (`hashed_blocks.cached_prefix_lens`).
    No real cache does better: it is the ceiling of the hit rate of a replay.

    Args:
      path: a trace whose every record has `hash_ids`.
      page_size: tokens per KV page.
      max_requests: only the first this many requests in arrival order.
      block_size: tokens per block where the file does not say (as `load_trace`).

    Returns:
      Cached prompt tokens over all prompt tokens, in [0, 1).
    """
    records = _sorted_records(Path(path), max_requests, block_size)
    missing = next((where for where, _, kwargs in records if "hash_ids" not in kwargs), None)
    if missing is not None:
        raise TraceError(f"{missing}: field 'hash_ids': missing (the prefix-cache ceiling "
                         f"needs every request's block ids)")
    prompt_lens = [int(kwargs["prompt_len"]) for _, _, kwargs in records]
    cached = cached_prefix_lens([kwargs["hash_ids"] for _, _, kwargs in records], prompt_lens,
                                page_size, int(records[0][2]["block_size"]))
    return float(cached.sum()) / sum(prompt_lens)


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
        values.append(parse_int(where, name, record[name], 1, MAX_LENGTH))
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
            if r.planned_output_tokens is not None:
                record["planned_output_tokens"] = r.planned_output_tokens.tolist()
            if r.conversation_id is not None:
                record["conversation_id"] = int(r.conversation_id)
                record["turn"] = int(r.turn)
            f.write(json.dumps(record) + "\n")
