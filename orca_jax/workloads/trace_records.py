"""One record of a trace file (a JSON object, or a CSV row as {column: cell}) as the
keyword arguments of a `Request`; the fields are listed in `traces` and docs/traces.md.

A record may lack its arrival time or its output length: whether the whole file lacks
it (an offline batch; lengths the caller gives) is `traces`' to judge.

Every error is a `TraceError` saying `file:line: field 'name': ...`.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.workloads.hashed_blocks import HASH_BLOCK_SIZE

# Canonical field name -> every name it may appear under in a file, preferred first.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "arrival_s": ("arrival_s", "arrived_at"),
    "arrival_ms": ("timestamp",),
    "prompt_len": ("prompt_len", "num_prefill_tokens", "input_length"),
    "output_len": ("output_len", "num_decode_tokens", "output_length"),
    "prompt_tokens": ("prompt_tokens",),
    "hash_ids": ("hash_ids",),
    "block_size": ("block_size",),
    "planned_output_tokens": ("planned_output_tokens",),
    "priority": ("priority",),
    "tenant": ("tenant",),
    "deadline_s": ("deadline_s",),
    "id": ("id",),
    "conversation_id": ("conversation_id",),
    "turn": ("turn",),
    "spec_acceptance": ("acceptance",),
}

_INT32_MAX = np.iinfo(np.int32).max
_INT64_MAX = np.iinfo(np.int64).max
# The longest prompt or output a file may give: token positions are int32 on the engine,
# and a larger count (1e20) would overflow the int64 arrays before any check could say why.
MAX_LENGTH = int(_INT32_MAX)


class TraceError(ValueError):
    """A trace file that cannot be loaded; the message names file, line and field."""


def field_error(where: str, name: str, expected: str, got: object) -> TraceError:
    """The error of a field's bad value: `where: field 'name': expected ..., got ...`."""
    return TraceError(f"{where}: field '{name}': expected {expected}, got {got!r}")


def _is_blank(raw: object) -> bool:
    return raw is None or (isinstance(raw, str) and raw.strip() == "")


def parse_int(where: str, name: str, raw: object, minimum: Optional[int],
              maximum: Optional[int] = None) -> int:
    """A cell or JSON value as an integer (`minimum` or more, `maximum` or less, where given)."""
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
        raise field_error(where, name, expected, raw)
    if maximum is not None and value > maximum:
        raise field_error(where, name, f"{expected} and at most {maximum}", raw)
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
        raise field_error(where, name, expected, raw)
    return value


def _parse_ids(where: str, name: str, raw: object, what: str, maximum: int) -> list[int]:
    """A list of ids in [0, maximum] (a JSON list, or space-separated in a CSV cell)."""
    expected = f"a non-empty list of {what} in [0, 2**{maximum.bit_length()})"
    items: list[object]
    if isinstance(raw, list):
        items = raw
    elif isinstance(raw, str):
        items = list(raw.split())
    else:
        raise field_error(where, name, expected, raw)
    if not items:
        raise field_error(where, name, expected, raw)
    ids = []
    for i, item in enumerate(items):
        try:
            value = parse_int(where, name, item, 0)
        except TraceError:
            raise field_error(where, name, f"{expected} (item {i})", item) from None
        if value > maximum:
            raise field_error(where, name, f"{expected} (item {i})", item)
        ids.append(value)
    return ids


def _parse_tokens(where: str, name: str, raw: object) -> NDArray[np.int32]:
    """`[num_tokens]` int32 token ids."""
    return np.asarray(_parse_ids(where, name, raw, "token ids", _INT32_MAX), dtype=np.int32)


def missing_field(where: str, canonical: str) -> TraceError:
    """The error of an absent field, naming every name it may have in a file."""
    names = " or ".join(f"'{n}'" for n in FIELD_ALIASES[canonical])
    if canonical == "arrival_s":
        names += " (seconds) or 'timestamp' (milliseconds)"
    return TraceError(f"{where}: field '{canonical}': missing (expected a column/key {names})")


# Where a length does not fit Mooncake's 512-token blocks: the file's may be another size.
_SIZE_HINT = "; blocks of another size: a 'block_size' field or --trace_block_size"


def parse_block_size(where: str, name: str, raw: object) -> int:
    """Tokens per block of `hash_ids` (a record's `block_size`, or the caller's)."""
    return parse_int(where, name, raw, 1, MAX_LENGTH)


def parse_record(record: dict, where: str, block_size: Optional[int] = None
                 ) -> tuple[Optional[int], dict[str, object]]:
    """Parses one record into (explicit id or None, Request keyword arguments without id).

    A record's `hash_ids` stay a list of ints under "hash_ids", with the tokens per block
    under "block_size": `load_trace` turns them into token ids for the requests it keeps.
    A record without an arrival time or an output length has no "arrival_s" or
    "output_len" key (the file decides: `traces`).

    Args:
      record: the record's fields ({column: cell} of a CSV row).
      where: `file:line`, for errors.
      block_size: tokens per block of `hash_ids` where the record gives no `block_size`
        (None: Mooncake's `HASH_BLOCK_SIZE`); a record that gives another is an error.
    """

    def lookup(canonical: str) -> Optional[tuple[str, object]]:
        """(name in the file, raw value) of the field, or None where absent or blank."""
        for name in FIELD_ALIASES[canonical]:
            if name in record:
                return None if _is_blank(record[name]) else (name, record[name])
        return None

    kwargs: dict[str, object] = {}
    found = lookup("arrival_s")
    if found is not None:
        kwargs["arrival_s"] = _parse_float(where, found[0], found[1], 0.0)
    elif (found := lookup("arrival_ms")) is not None:
        kwargs["arrival_s"] = _parse_float(where, found[0], found[1], 0.0) / 1000

    tokens = None
    found = lookup("prompt_tokens")
    if found is not None:
        tokens = _parse_tokens(where, found[0], found[1])
    blocks = None
    stated = None
    size = HASH_BLOCK_SIZE if block_size is None else block_size
    found = lookup("hash_ids")
    if found is not None:
        if tokens is not None:
            raise TraceError(f"{where}: field '{found[0]}': expected either 'prompt_tokens' or "
                             f"'{found[0]}', got both")
        blocks = _parse_ids(where, found[0], found[1], "block ids", _INT64_MAX)
        kwargs["hash_ids"] = blocks
        stated = lookup("block_size")
        if stated is not None:
            size = parse_block_size(where, stated[0], stated[1])
            if block_size is not None and size != block_size:
                raise field_error(where, stated[0], f"{block_size} (the caller's block size, "
                                  f"--trace_block_size; a file that states its own needs none)",
                                  stated[1])
        kwargs["block_size"] = size
    found = lookup("prompt_len")
    if found is not None:
        prompt_len = parse_int(where, found[0], found[1], 1, MAX_LENGTH)
        if tokens is not None and len(tokens) != prompt_len:
            raise field_error(where, "prompt_tokens", f"{prompt_len} token ids ('{found[0]}')",
                              f"{len(tokens)} token ids")
        if blocks is not None and not (
                (len(blocks) - 1) * size < prompt_len <= len(blocks) * size):
            raise field_error(where, found[0],
                              f"more than {(len(blocks) - 1) * size} and at most "
                              f"{len(blocks) * size} tokens ({len(blocks)} blocks of "
                              f"{size} in 'hash_ids'{'' if stated or block_size else _SIZE_HINT})",
                              prompt_len)
    elif tokens is not None:
        prompt_len = len(tokens)
    elif blocks is not None:
        prompt_len = len(blocks) * size
    else:
        raise TraceError(f"{where}: field 'prompt_len': missing (expected a column/key "
                         f"'prompt_len', 'num_prefill_tokens', 'input_length', 'prompt_tokens' "
                         f"or 'hash_ids')")
    kwargs["prompt_len"] = prompt_len
    kwargs["prompt_tokens"] = tokens

    found = lookup("output_len")
    output_len = None
    if found is not None:
        kwargs["output_len"] = output_len = parse_int(where, found[0], found[1], 1, MAX_LENGTH)
    found = lookup("planned_output_tokens")
    if found is not None:
        answer = _parse_tokens(where, found[0], found[1])
        if output_len is None:  # the planned answer says how long it is
            kwargs["output_len"] = output_len = len(answer)
        if len(answer) != output_len:
            raise field_error(where, found[0], f"{output_len} token ids (the output length)",
                              f"{len(answer)} token ids")
        kwargs["planned_output_tokens"] = answer

    found = lookup("priority")
    if found is not None:
        kwargs["priority"] = parse_int(where, found[0], found[1], None)
    found = lookup("tenant")
    if found is not None:
        if not isinstance(found[1], str):
            raise field_error(where, found[0], "a string", found[1])
        kwargs["tenant"] = found[1]
    found = lookup("deadline_s")
    if found is not None:
        kwargs["deadline_s"] = _parse_float(where, found[0], found[1], None)
    conversation, turn = lookup("conversation_id"), lookup("turn")
    if (conversation is None) != (turn is None):
        raise missing_field(where, "turn" if turn is None else "conversation_id")
    if conversation is not None and turn is not None:
        kwargs["conversation_id"] = parse_int(where, conversation[0], conversation[1], None)
        kwargs["turn"] = parse_int(where, turn[0], turn[1], 0)
    found = lookup("spec_acceptance")
    if found is not None:
        rate = _parse_float(where, found[0], found[1], 0.0)
        if rate > 1.0:
            raise field_error(where, found[0], "a per-token acceptance rate in [0, 1]",
                              found[1])
        kwargs["spec_acceptance"] = rate
    explicit_id = None
    found = lookup("id")
    if found is not None:
        explicit_id = parse_int(where, found[0], found[1], None)
    return explicit_id, kwargs


