"""A spec field's documentation as data, and the checks the spec parts share.

`knob` makes a dataclass field whose help, choices and presets the command-line flags
take (`experiments/flags.py`, checked by tests/test_flag_spec_consistency.py); the
`check_*` functions refuse a bad value in one line naming the part and field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional


def knob(default: object, help_text: str, *, choices: tuple[str, ...] = (),
         presets: tuple[str, ...] = (), registry: Optional[str] = None) -> Any:
    """A spec field with its documentation as data: the command-line flag of the field takes
    its default and help from here (`experiments/flags.py`, checked by
    tests/test_flag_spec_consistency.py).

    Args:
      default: the field's default.
      help_text: what the field means (the flag's help).
      choices: the only values allowed (checked in `__post_init__`).
      presets: the named presets a value may be (others may be allowed: a path, a name).
      registry: the plugin registry whose names a value may be (`router`), besides a
        plugin spec; filled in where the registry is (the built-ins register on import).
    """
    return dataclasses.field(default=default, metadata={
        "help": help_text, "choices": choices, "presets": presets, "registry": registry})


def field_doc(part: type, name: str) -> dict[str, Any]:
    """A spec field's documentation (`knob`'s metadata: help, choices, presets, registry);
    empty for a field without one."""
    return dict(spec_field(part, name).metadata)


def spec_field(part: type, name: str) -> dataclasses.Field:
    """The field `name` of the dataclass `part`."""
    return _fields_by_name(part)[name]


@functools.lru_cache(maxsize=None)
def _fields_by_name(part: type) -> dict[str, dataclasses.Field]:
    # Once per part: the run flags ask for each field's doc several times as they are
    # defined, and `dataclasses.fields` builds the whole tuple each time.
    return {field.name: field for field in dataclasses.fields(part)}


def sampling_params(text: str) -> tuple[float, int, float]:
    """Parses `greedy` or `temperature:T[:top_k[:top_p]]` into (temperature, top_k, top_p)."""
    if text == "greedy":
        return 0.0, 0, 1.0
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind != "temperature" or not 1 <= len(parts) <= 3:
            raise ValueError
        temperature = float(parts[0])
        top_k = int(parts[1]) if len(parts) > 1 else 0
        top_p = float(parts[2]) if len(parts) > 2 else 1.0
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"sampling {text!r}: expected greedy or temperature:T[:TOP_K[:TOP_P]] "
                         "with T >= 0, TOP_K >= 0, 0 < TOP_P <= 1") from None
    return temperature, top_k, top_p


def check_choice(part: str, field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{part}.{field} must be one of {choices}, got {value!r}")


def check_at_least(part: str, field: str, value: Optional[float], lowest: float) -> None:
    if value is not None and not value >= lowest:
        raise ValueError(f"{part}.{field} must be >= {lowest:g}, got {value}")


def check_positive(part: str, field: str, value: Optional[float], what: str = "") -> None:
    """A finite number > 0 (or None): nan, inf and 0 are refused here, by name, not deep
    in the run as a division by zero or an endless loop."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{part}.{field} must be a finite number > 0{what}, got {value}")

