"""Program traces: agent programs read from JSON Lines files (docs/programs.md).

Two schemas, told apart line by line:

  * ours, one call per line: `program_id`, `call_index`, `prompt_len`,
    `output_len`, `parents` (call indices, default none), `tool_s` (the pause
    after the latest parent, default 0) and `arrival_s` (the program's start,
    read for a call without parents; default 0).
  * the GitHub Copilot coding-agent trace (Azure/AzurePublicDataset, 2026), one
    session per line: `session_id`, `turns` -> `llm_calls` (`message_id`,
    `timestamp`, `duration_ms`, `result`, `tokens.prompt`, `tokens.completion`)
    and `tool_batches` (`request_id`, the `message_id` of the call that asked for
    the tools, and `duration_ms`). A session is one sequential program: each call
    waits for the call before it, plus the tool batches that call asked for
    (their `duration_ms`, summed), and a turn's first call also waits the user's
    gap (its timestamp less the previous call's end and tools). A call cancelled
    by the user (`result` other than Success) is served as the trace counted it:
    its prompt and the completion tokens it got (at least 1).

Each line's errors are one line naming the file and the line (a cycle of
parents, an unknown parent, a negative tool time, a missing token count).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from orca_jax.core.requests.request import Request
from orca_jax.workloads.programs import ProgramCall, program_requests
from orca_jax.workloads.synthetic import check_seed, check_vocab_size, random_tokens
from orca_jax.workloads.trace_records import (
    MAX_LENGTH,
    TraceError,
    field_error,
    parse_int,
)
from orca_jax.workloads.traces import _jsonl_objects

PathLike = Union[str, "os.PathLike[str]"]


def _number(where: str, name: str, raw: object, minimum: float = 0.0) -> float:
    """A finite number >= `minimum` (a negative tool time is an error, not a zero)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not np.isfinite(raw) \
            or raw < minimum:
        raise field_error(where, name, f"a finite number >= {minimum:g}", raw)
    return float(raw)


def _tokens(where: str, name: str, tokens: object, key: str, minimum: int) -> int:
    if not isinstance(tokens, dict) or key not in tokens or tokens[key] is None:
        raise TraceError(f"{where}: field '{name}': missing (a token count)")
    return parse_int(where, name, tokens[key], minimum, MAX_LENGTH)


def _our_call(where: str, record: dict) -> ProgramCall:
    for name in ("program_id", "call_index", "prompt_len", "output_len"):
        if record.get(name) is None:
            raise TraceError(f"{where}: field '{name}': missing")
    parents = record.get("parents") or []
    if not isinstance(parents, list):
        raise field_error(where, "parents", "a list of call indices", parents)
    return ProgramCall(
        program=parse_int(where, "program_id", record["program_id"], None),
        call=parse_int(where, "call_index", record["call_index"], 0),
        parents=tuple(parse_int(where, "parents", p, 0) for p in parents),
        tool_s=_number(where, "tool_s", record.get("tool_s", 0.0)),
        prompt_len=parse_int(where, "prompt_len", record["prompt_len"], 1, MAX_LENGTH),
        output_len=parse_int(where, "output_len", record["output_len"], 1, MAX_LENGTH),
        start_s=_number(where, "arrival_s", record.get("arrival_s", 0.0)))


def _timestamp(where: str, raw: object) -> Optional[float]:
    """An ISO-8601 timestamp in seconds since the epoch (None when absent)."""
    if raw is None:
        return None
    try:
        stamp = datetime.datetime.fromisoformat(str(raw))
    except ValueError:
        raise field_error(where, "timestamp", "an ISO-8601 time", raw) from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp()


def _session_calls(where: str, record: dict, program: int) -> list[tuple[ProgramCall, float]]:
    """A Copilot session's calls as one sequential program, each with its timestamp
    (seconds; the program's start is its first call's)."""
    turns = record.get("turns")
    if not isinstance(turns, list):
        raise field_error(where, "turns", "a list of turns", turns)
    calls: list[tuple[ProgramCall, float]] = []
    prev_end: Optional[float] = None  # the previous call's end and its tools
    tools_of_prev = 0.0  # seconds of the tools the previous call asked for
    for t, turn in enumerate(turns):
        llm = (turn or {}).get("llm_calls") or []
        tools: dict[str, float] = {}
        for b, batch in enumerate((turn or {}).get("tool_batches") or []):
            ms = _number(where, f"turns[{t}].tool_batches[{b}].duration_ms",
                         batch.get("duration_ms", 0.0))
            key = str(batch.get("request_id"))
            tools[key] = tools.get(key, 0.0) + ms / 1000
        order = sorted(range(len(llm)), key=lambda i: str(llm[i].get("timestamp") or ""))
        for k, i in enumerate(order):
            call = llm[i]
            name = f"turns[{t}].llm_calls[{i}]"
            prompt = _tokens(where, f"{name}.tokens.prompt", call.get("tokens"), "prompt", 1)
            completion = _tokens(where, f"{name}.tokens.completion", call.get("tokens"),
                                 "completion", 0)
            stamp = _timestamp(where, call.get("timestamp"))
            pause = 0.0
            if calls:
                before = calls[-1][0]
                pause = tools_of_prev
                if k == 0 and stamp is not None and prev_end is not None:
                    pause = max(pause, stamp - prev_end)  # the user's gap before the turn
            start = stamp if stamp is not None else 0.0
            calls.append((ProgramCall(
                program=program, call=len(calls), parents=(before.call,) if calls else (),
                tool_s=pause, prompt_len=prompt, output_len=max(completion, 1),
                start_s=start), start))
            duration = _number(where, f"{name}.duration_ms", call.get("duration_ms", 0.0))
            tools_of_prev = tools.get(str(call.get("message_id")), 0.0)
            prev_end = None if stamp is None else stamp + duration / 1000 + tools_of_prev
    if not calls:
        raise TraceError(f"{where}: session {record.get('session_id')!r} has no llm_calls")
    return calls


def _check_graph(calls: list[tuple[str, ProgramCall]]) -> list[ProgramCall]:
    """Checks each program's parents (known calls, no cycle, each index once) and
    returns the calls with every parent before its children; the first error names
    the line."""
    by_key: dict[tuple[int, int], tuple[str, ProgramCall]] = {}
    for where, c in calls:
        if (c.program, c.call) in by_key:
            raise TraceError(f"{where}: program {c.program} has call {c.call} twice (also "
                             f"{by_key[(c.program, c.call)][0]})")
        by_key[(c.program, c.call)] = (where, c)
    for where, c in calls:
        for p in c.parents:
            if (c.program, p) not in by_key:
                raise TraceError(f"{where}: program {c.program} call {c.call} names parent "
                                 f"call {p}, which the file does not have")
    ordered: list[ProgramCall] = []
    state: dict[tuple[int, int], int] = {}  # 1: on the path, 2: placed
    for where, c in calls:
        stack = [((c.program, c.call), 0)]
        while stack:
            key, i = stack.pop()
            if i == 0:
                if state.get(key) == 2:
                    continue
                state[key] = 1
            node = by_key[key][1]
            if i < len(node.parents):
                stack.append((key, i + 1))
                child = (node.program, node.parents[i])
                if state.get(child) == 1:
                    raise TraceError(f"{by_key[child][0]}: program {node.program} call "
                                     f"{child[1]} lies on a cycle of parents")
                if state.get(child) != 2:
                    stack.append((child, 0))
                continue
            state[key] = 2
            ordered.append(node)
    return ordered


def load_program_trace(path: PathLike, *, max_requests: Optional[int] = None,
                       vocab_size: Optional[int] = None, seed: int = 0,
                       time_scale: float = 1.0) -> list[Request]:
    """The calls of a program trace (either schema, see the module) as requests.

    Args:
      path: a JSON Lines file.
      max_requests: keep the first calls in planned arrival order (None: all).
      vocab_size: give each program's prompts ids that hold its history (a call whose
        prompt is at least the previous call's prompt and answer extends them), for a
        prefix cache; None: lengths only.
      seed: the ids' seed.
      time_scale: multiplies program starts and tool pauses (0.5: twice as fast).

    Raises:
      TraceError: one line naming the file, the line and what is wrong.
    """
    path = Path(path)
    calls: list[tuple[str, ProgramCall]] = []
    sessions: dict[str, int] = {}
    first_stamp: Optional[float] = None
    copilot: set[int] = set()  # ids of the calls whose starts are timestamps
    for where, record in _jsonl_objects(path):
        if "turns" in record or "session_id" in record:
            program = sessions.setdefault(str(record.get("session_id", where)), len(sessions))
            session = _session_calls(where, record, program)
            start = session[0][1]
            first_stamp = start if first_stamp is None else min(first_stamp, start)
            calls.extend((where, c) for c, _ in session)
            copilot.update(id(c) for c, _ in session)
        else:
            calls.append((where, _our_call(where, record)))
    if not calls:
        raise TraceError(f"{path}: no calls")
    ordered = _check_graph(calls)
    for c in ordered:
        if id(c) in copilot:
            c.start_s -= first_stamp  # seconds from the file's first session
        c.start_s *= time_scale
        c.tool_s *= time_scale
    if vocab_size is not None:
        _give_ids(ordered, vocab_size, seed)
    return program_requests(ordered, max_requests)


def _give_ids(calls: list[ProgramCall], vocab_size: int, seed: int) -> None:
    """Ids whose prefixes follow each program's history: a call extends its first
    parent's prompt and answer where its prompt is long enough, else starts afresh."""
    check_vocab_size(vocab_size)
    check_seed(seed)
    done: dict[tuple[int, int], ProgramCall] = {}
    for c in calls:
        rng = np.random.default_rng(np.random.SeedSequence(
            int(seed), spawn_key=(2, c.program % 2**32, c.call)))
        base = np.zeros(0, dtype=np.int32)
        if c.parents:
            parent = done[(c.program, c.parents[0])]
            history = np.concatenate([parent.prompt, parent.answer])
            if history.size <= c.prompt_len:
                base = history
        c.prompt = np.concatenate([base, random_tokens(rng, c.prompt_len - base.size,
                                                       vocab_size)])
        c.answer = random_tokens(rng, c.output_len, vocab_size)
        done[(c.program, c.call)] = c
