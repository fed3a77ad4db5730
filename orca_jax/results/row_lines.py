"""requests.jsonl and steps.jsonl lines, made from one format string per row.

A simulated run writes a steps.jsonl line every step and a requests.jsonl line
for every request, twice (streamed as it finishes, then in arrival order): with
`json.dumps` of `step_row`/`request_row` that was a quarter of a simulated run's
process time. `step_line` and `request_line` are exactly `json.dumps` of those
rows (tests compare them on every kind of value), made by one `%` format of the
fields' texts instead of a dict and a `json.dumps` per row. A value the format
does not expect (not a plain int, or a float that is not finite) takes the row
and `json.dumps`, so a line is always the row's JSON.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import operator
import typing
from json.encoder import encode_basestring_ascii  # json.dumps' own string encoder
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.json_files import to_json_value
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import SpecCounts
from orca_jax.core.requests.run_record import StepLog
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.summary import (
    ProgramFields,
    SpecFields,
    iter_step_rows,
    program_fields,
    request_row,
    request_row_args,
    spec_fields,
    step_row,
)

if TYPE_CHECKING:  # a hint only: token times are a --log_token_times run's (`results.qoe`)
    from orca_jax.results.qoe import TokenTimes

_FINISHED, _REJECTED = int(RequestState.FINISHED), int(RequestState.REJECTED)
_STATUS = {_FINISHED: '"finished"', _REJECTED: '"rejected"'}  # else "unfinished"
_float_repr = float.__repr__  # json.dumps' text of a finite float


_STEP_KINDS = tuple(map(typing.get_type_hints(StepLog).__getitem__, StepLog._fields))  # once
_FLOAT_FIELDS = operator.itemgetter(*[k for k, kind in enumerate(_STEP_KINDS) if kind is float])
_UNCACHED_FIELDS = operator.itemgetter(  # the fields of a run without prefix caching
    *[k for k, name in enumerate(StepLog._fields) if name != "num_cached_tokens"])


def _step_format(fields: Sequence[int]) -> str:
    """`{"name": %d, "name": %r, ...}` of the StepLog fields of indices `fields`: `%d`
    writes an int and `%r` a finite float as `json.dumps` does."""
    return "{" + ", ".join(f'"{StepLog._fields[k]}": ' + ("%d" if _STEP_KINDS[k] is int
                                                         else "%r") for k in fields) + "}"


_STEP_FORMAT = {True: _step_format(range(len(StepLog._fields))),  # by prefix_caching
                False: _step_format(_UNCACHED_FIELDS(range(len(StepLog._fields))))}


def step_line(step: StepLog, *, prefix_caching: bool, replica: Optional[int] = None) -> str:
    """`json.dumps(step_row(step, prefix_caching=..., replica=...))`: a steps.jsonl line
    (without the fields of `log_step_requests`), no newline."""
    # Plain ints and floats (a numpy value or a bool is not) and finite floats (an
    # overflowing sum only sends a finite step the slow way).
    if tuple(map(type, step)) != _STEP_KINDS or not math.isfinite(sum(_FLOAT_FIELDS(step))):
        return json.dumps(step_row(step, prefix_caching=prefix_caching, replica=replica))
    line = _STEP_FORMAT[prefix_caching] % (step if prefix_caching else _UNCACHED_FIELDS(step))
    if replica is None:
        return line
    return f'{{"replica": {int(replica)}, {line[1:]}'


def step_lines(steps: Sequence[StepLog], *, prefix_caching: bool,
               replicas: Optional[Sequence[int]] = None) -> list[str]:
    """`step_line(step, prefix_caching=..., replica=...)` of each of `steps` (`replicas`:
    each step's, None: a run of one replica): with every field of every step of its kind
    and every float finite (checked a column at a time), one `%` format a step."""
    if not steps:
        return []
    fields = list(zip(*steps))  # [field][step]
    if all(set(map(type, column)) == {kind} for column, kind in zip(fields, _STEP_KINDS)) \
            and math.isfinite(sum(map(sum, _FLOAT_FIELDS(fields)))):
        line_format = _STEP_FORMAT[prefix_caching]
        columns = fields if prefix_caching else list(_UNCACHED_FIELDS(fields))
        if replicas is None:
            return list(map(line_format.__mod__, zip(*columns) if not prefix_caching
                            else steps))
        return list(map(('{"replica": %d, ' + line_format[1:]).__mod__,
                        zip(map(int, replicas), *columns)))
    return [step_line(step, prefix_caching=prefix_caching,
                      replica=None if replicas is None else replicas[k])
            for k, step in enumerate(steps)]


def _time_text(value: Any) -> str:
    """A time column's JSON: the float, or null where it is not finite (unset: NaN)."""
    number = float(value)
    return _float_repr(number) if number - number == 0.0 else "null"


_REQUEST_FORMAT = ('{"id": %s, "arrival_s": %s, "first_scheduled_s": %s, "first_token_s": %s, '
                   '"last_token_s": %s, "finish_s": %s, "prompt_len": %d, "output_len": %d, '
                   '"num_generated": %d, "num_preemptions": %d, "priority": %d, "tenant": %s, '
                   '"status": %s')


def request_line(columns: Any, i: int, *, request_id: Any, tenant: str, reason: Optional[str],
                 output_tokens: Optional[Sequence[int]], prefix_caching: bool,
                 replica: Optional[int] = None, prefill_replica: Optional[int] = None,
                 token_times: Optional[Sequence[float]] = None,
                 qoe: Optional[float] = None, program: Optional[ProgramFields] = None,
                 speculation: Optional[SpecFields] = None) -> str:
    """`json.dumps(request_row(columns, i, ...))` (the same arguments): a requests.jsonl
    line, no newline."""
    if type(request_id) is not int or type(tenant) is not str:  # a trace's own id, say
        return json.dumps(request_row(
            columns, i, request_id=request_id, tenant=tenant, reason=reason,
            output_tokens=output_tokens, prefix_caching=prefix_caching, replica=replica,
            prefill_replica=prefill_replica, token_times=token_times, qoe=qoe,
            program=program, speculation=speculation))
    state = int(columns.state[i])
    line = _REQUEST_FORMAT % (
        int.__repr__(request_id), _time_text(columns.arrival_s[i]),
        _time_text(columns.first_scheduled_s[i]), _time_text(columns.first_token_s[i]),
        _time_text(columns.last_token_s[i]), _time_text(columns.finish_s[i]),
        columns.prompt_len[i], columns.output_len[i], columns.num_generated[i],
        columns.num_preemptions[i], columns.priority[i], encode_basestring_ascii(tenant),
        _STATUS.get(state, '"unfinished"'))
    if state == _REJECTED:
        line += f', "reason": {json.dumps(to_json_value(reason))}'
    if program is not None:
        line += _program_text(program)
    if prefix_caching:
        line += f', "num_cached_tokens": {int(columns.num_cached_tokens[i])}'
    if output_tokens is not None:
        line += f', "output_tokens": {json.dumps(to_json_value(list(output_tokens)))}'
    if replica is not None:
        line += f', "replica": {int(replica)}'
    if prefill_replica is not None:
        line += f', "prefill_replica": {int(prefill_replica)}'
    if token_times is not None:
        line += (f', "token_times": {json.dumps(to_json_value(list(token_times)))}, '
                 f'"qoe": {json.dumps(to_json_value(qoe))}')
    if speculation is not None:
        line += _spec_text(speculation)
    return line + "}"


def _spec_text(speculation: SpecFields) -> str:
    """A row's `drafted_tokens` and `accepted_tokens` columns."""
    drafted, accepted = speculation
    return f', "drafted_tokens": {int(drafted)}, "accepted_tokens": {int(accepted)}'


def _program_text(program: ProgramFields) -> str:
    """A row's `program_id` and `call_index` columns (null: not a call of a program)."""
    program_id, call_index = program
    return (f', "program_id": {"null" if program_id is None else int(program_id)}, '
            f'"call_index": {"null" if call_index is None else int(call_index)}')


# Rows made at a time by `plain_request_lines`: its columns' lists are this long at most.
_LINES_AT_ONCE = 4096
_TIME_FIELDS = ("arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s")
_INT_FIELDS = ("prompt_len", "output_len", "num_generated", "num_preemptions", "priority")
# Each state's `"status"` text (a rejected row's reason follows it).
_STATUS_TEXTS = tuple(_STATUS.get(state, '"unfinished"') for state in range(len(RequestState)))
_plain_formats: dict[tuple, str] = {}  # `_plain_format`'s, by its arguments


def _plain_format(program: bool, cached: bool, replica: bool, prefill_replica: bool,
                  spec: bool) -> str:
    """`plain_request_lines`' format of a whole line: `_REQUEST_FORMAT`, the id as `%d`,
    and the optional columns, in `request_line`'s order, after the status (which
    carries a rejected row's reason)."""
    key = (program, cached, replica, prefill_replica, spec)
    if key not in _plain_formats:
        _plain_formats[key] = (_REQUEST_FORMAT.replace("%s", "%d", 1)
                               + ("%s" if program else "")
                               + (', "num_cached_tokens": %d' if cached else "")
                               + (', "replica": %d' if replica else "")
                               + (', "prefill_replica": %d' if prefill_replica else "")
                               + (', "drafted_tokens": %d, "accepted_tokens": %d' if spec
                                  else "") + "}")
    return _plain_formats[key]


def _time_texts(columns: Any, index: NDArray[np.int64]) -> list[list[str]]:
    """`_time_text` of each time column of the rows `index`, a list per column.

    A float's text is the costliest part of a line: rows share times (a request's
    last token is its finish; requests admitted, or finished, in one step share its
    time), so each distinct value is written once, all at once (the list's own repr is
    each float's `float.__repr__`, json.dumps' text, made in C; split at its separators,
    as no float's text has a comma). Values are told apart by their bits: -0.0 is not 0.0.
    """
    block = np.stack([np.asarray(getattr(columns, name)[index], dtype=np.float64)
                      for name in _TIME_FIELDS])  # [5, r]
    bits, inverse = np.unique(block.view(np.int64).ravel(), return_inverse=True)  # [u], [5r]
    values = bits.view(np.float64)  # [u]
    texts = repr(values.tolist())[1:-1].split(", ")
    for k in np.flatnonzero(~np.isfinite(values)).tolist():  # NaN (unset) or inf: null
        texts[k] = "null"
    flat = list(map(texts.__getitem__, inverse.ravel().tolist()))
    r = block.shape[1]
    return [flat[k * r:(k + 1) * r] for k in range(len(_TIME_FIELDS))]


def plain_request_lines(columns: Any, rows: Sequence[int], *, request_ids: Sequence[Any],
                        tenants: Sequence[str], reasons: Sequence[Optional[str]],
                        prefix_caching: bool,
                        programs: Optional[Sequence[ProgramFields]] = None,
                        speculation: Optional[SpecCounts] = None,
                        replicas: Optional[Sequence[int]] = None,
                        prefill_replicas: Optional[Sequence[int]] = None) -> list[str]:
    """`request_line(columns, i, request_id=..., tenant=..., reason=..., output_tokens=None,
    prefix_caching=..., program=..., speculation=..., replica=..., prefill_replica=...)` of
    each `i` of `rows` (`request_ids`, `tenants`, `reasons`, `programs` (None: a run
    without programs), `replicas` and `prefill_replicas` (None: a run without the column):
    each row's, in the same order; `speculation`: the run's counts, None where it does
    not speculate): the
    same lines, with each column read once for all rows (a list of Python values) and
    one `%` format a line (`_plain_format`), each distinct time's text made once."""
    if not (set(map(type, request_ids)) <= {int} and set(map(type, tenants)) <= {str}):
        # A trace's own ids, say: those rows the slow way, the others as below.
        odd = [k for k, (request_id, tenant) in enumerate(zip(request_ids, tenants))
               if type(request_id) is not int or type(tenant) is not str]
        lines: list[Optional[str]] = [None] * len(rows)
        for k in odd:
            i = int(rows[k])
            lines[k] = request_line(columns, i, request_id=request_ids[k], tenant=tenants[k],
                                    reason=reasons[k], output_tokens=None,
                                    prefix_caching=prefix_caching,
                                    program=programs[k] if programs is not None else None,
                                    speculation=spec_fields(speculation, i),
                                    replica=replicas[k] if replicas is not None else None,
                                    prefill_replica=(prefill_replicas[k] if prefill_replicas
                                                     is not None else None))
        plain = sorted(set(range(len(rows))) - set(odd))
        pick = operator.itemgetter(*plain) if len(plain) > 1 else (
            lambda values: tuple(values[k] for k in plain))
        for k, line in zip(plain, plain_request_lines(
                columns, list(pick(rows)), request_ids=list(pick(request_ids)),
                tenants=list(pick(tenants)), reasons=list(pick(reasons)),
                prefix_caching=prefix_caching,
                programs=None if programs is None else list(pick(programs)),
                speculation=speculation,
                replicas=None if replicas is None else list(pick(replicas)),
                prefill_replicas=(None if prefill_replicas is None
                                  else list(pick(prefill_replicas))))):
            lines[k] = line
        return lines  # type: ignore[return-value]
    if not len(rows):
        return []
    index = np.asarray(rows, dtype=np.int64)  # [r]
    states = columns.state[index].tolist()
    status = list(map(_STATUS_TEXTS.__getitem__, states))
    if _REJECTED in states:  # + its reason
        for k in [k for k, state in enumerate(states) if state == _REJECTED]:
            status[k] += f', "reason": {json.dumps(to_json_value(reasons[k]))}'
    columns_of_rows = [request_ids, *_time_texts(columns, index),
                       *[getattr(columns, name)[index].tolist() for name in _INT_FIELDS],
                       map(encode_basestring_ascii, tenants), status]
    if programs is not None:
        columns_of_rows.append(map(_program_text, programs))
    if prefix_caching:
        columns_of_rows.append(columns.num_cached_tokens[index].tolist())
    for column in (replicas, prefill_replicas):
        if column is not None:
            columns_of_rows.append(map(int, column))
    if speculation is not None:
        columns_of_rows += [speculation.drafted[index].tolist(),
                            speculation.accepted[index].tolist()]
    line_format = _plain_format(programs is not None, prefix_caching, replicas is not None,
                                prefill_replicas is not None, speculation is not None)
    return list(map(line_format.__mod__, zip(*columns_of_rows)))


def iter_request_lines(result: RunResult,
                       token_times: Optional[TokenTimes] = None) -> Iterator[str]:
    """`json.dumps` of each of `iter_request_rows(result, token_times)`, one at a time."""
    if token_times is None and result.output_tokens is None:  # the plain rows: many at once
        names = result.tenant_names
        several = result.num_replicas > 1
        for start in range(0, result.num_requests, _LINES_AT_ONCE):
            stop = min(start + _LINES_AT_ONCE, result.num_requests)
            yield from plain_request_lines(
                result, range(start, stop), request_ids=result.request_ids[start:stop],
                tenants=[names[t] for t in result.tenant[start:stop].tolist()],
                reasons=result.reject_reason[start:stop],
                prefix_caching=result.prefix_caching,
                programs=(None if result.programs is None else
                          [program_fields(result.programs, i) for i in range(start, stop)]),
                speculation=result.speculation,
                replicas=result.replica[start:stop].tolist() if several else None,
                prefill_replicas=(None if result.prefill_replica is None
                                  else result.prefill_replica[start:stop].tolist()))
        return
    # Lazy: only the rows with token times or output tokens get here; the plain rows above
    # (most runs') never import `results.qoe`.
    from orca_jax.results.qoe import row_fields
    for i in range(result.num_requests):
        yield request_line(result, i, **request_row_args(result, i),
                           **row_fields(token_times, i))


# A row's streamed line is taken only within this many lines of where its arrival order
# puts it (`request_lines_from_streamed`): the lines held at once stay ~2x this many
# (~15 MB), however late a request finished; one further out is formatted again.
_STREAMED_REACH = 16384


def reusable_streamed_rows(result: RunResult, line_of: NDArray[np.int64],
                           token_times: Optional[TokenTimes] = None
                           ) -> Optional[NDArray[np.bool_]]:
    """`[N]` which of `result`'s rows have their final requests.jsonl line (that of
    `iter_request_lines(result, token_times)`) in the streamed file already: every
    finished request streamed (`line_of[i]`: its line there, -1: not streamed, as
    `orca_jax.runner.live_results` keeps it), whose streamed line (`plain_request_lines`
    of the live table, no reason) is its final one. None where no row's is: a row that
    ends with more fields (output tokens, token times, a replica), or a run of programs
    (a call's final arrival is its release).

    Args:
      result: the finished run.
      line_of: `[N]` each request's line in the streamed requests.jsonl, -1 if not there.
      token_times: what the final rows add, if anything.
    """
    if (token_times is not None or result.output_tokens is not None or result.num_replicas != 1
            or result.prefill_replica is not None or result.programs is not None):
        return None
    # A rejected row streams no reason; an unfinished one did not stream.
    return (line_of >= 0) & (np.asarray(result.state) == _FINISHED)  # [N]


def request_lines_from_streamed(result: RunResult, streamed: Iterable[str],
                                line_of: NDArray[np.int64],
                                reusable: NDArray[np.bool_]) -> Iterator[str]:
    """`iter_request_lines(result)` (the plain rows), taking each `reusable` row's line
    from the `streamed` lines (the streamed requests.jsonl's, in file order, no newline;
    row `i`'s is line `line_of[i]`) instead of formatting it again; the others, and a row
    that finished far out of its arrival order, are formatted.

    The streamed lines are read once, in order, and each is held only until its row's
    turn: at most ~2 x `_STREAMED_REACH` lines at once.

    Args:
      result: the finished run.
      streamed: the streamed requests.jsonl's lines.
      line_of: `[N]` each request's line in `streamed`, -1 if not there.
      reusable: `[N]` the rows whose streamed line is their final one
        (`reusable_streamed_rows`).
    """
    n = result.num_requests
    in_file = line_of >= 0  # [N]
    rank = np.cumsum(in_file) - in_file  # [N] streamed rows before it, in arrival order
    take = reusable & (np.abs(line_of - rank) <= _STREAMED_REACH)  # [N]
    lines = iter(streamed)
    window: list[str] = []  # streamed lines [base, base + len(window))
    base = 0
    names = result.tenant_names
    for start in range(0, n, _LINES_AT_ONCE):
        stop = min(start + _LINES_AT_ONCE, n)
        taken = take[start:stop]  # [r]
        need = line_of[start:stop][taken] - base  # [t] in the window
        if need.size:
            missing = int(need.max()) + 1 - len(window)
            if missing > 0:
                window.extend(itertools.islice(lines, missing))
                if int(need.max()) >= len(window):
                    raise ValueError("the streamed requests.jsonl is shorter than its rows")
        if taken.all():
            chunk = [window[k] for k in need.tolist()]
        else:
            rows = np.flatnonzero(~taken) + start  # [r - t]
            fresh = plain_request_lines(
                result, rows, request_ids=[result.request_ids[i] for i in rows.tolist()],
                tenants=[names[t] for t in result.tenant[rows].tolist()],
                reasons=[result.reject_reason[i] for i in rows.tolist()],
                prefix_caching=result.prefix_caching, speculation=result.speculation)
            merged = np.empty(stop - start, dtype=object)  # [r]
            merged[taken] = [window[k] for k in need.tolist()]
            merged[~taken] = fresh
            chunk = merged.tolist()
        yield from chunk
        if stop < n:  # the rows to come take lines from rank[stop] - reach on
            drop = int(rank[stop]) - _STREAMED_REACH - base
            if drop > len(window):  # not read yet, and no row to come takes them
                collections.deque(itertools.islice(lines, drop - len(window)), maxlen=0)
            if drop > 0:
                del window[:drop]
                base += drop


def iter_step_lines(result: RunResult) -> Iterator[str]:
    """`json.dumps` of each of `iter_step_rows(result)`, one at a time."""
    if result.step_requests is not None or result.step_preempted is not None:
        yield from (json.dumps(row) for row in iter_step_rows(result))
        return
    several = result.num_replicas > 1
    for start in range(0, len(result.steps), _LINES_AT_ONCE):
        stop = start + _LINES_AT_ONCE
        yield from step_lines(result.steps[start:stop], prefix_caching=result.prefix_caching,
                              replicas=result.step_replica[start:stop].tolist() if several
                              else None)
