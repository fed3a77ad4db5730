"""The flags of entry points that run several policies (compare, sweep).

`--policies` lists policy specs; `--policy_opts` (shared with run) takes
`policy.key=value,...`, with `policy` as named in `--policies`.
"""

from __future__ import annotations

import os
from collections import defaultdict

from absl import flags

import policies

flags.DEFINE_list("policies", ["static", "orca"], "Policies to compare (names or plugin paths).")


def policy_label(spec: str) -> str:
    """A short name for a policy spec: `orca`, or the class of `path/file.py:Class`."""
    return os.path.splitext(os.path.basename(spec.rpartition(":")[2] or spec))[0]


def options_by_policy(text: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Splits `policy.key=value,...` into each policy's own options."""
    by_policy: dict[str, dict[str, str]] = defaultdict(dict)
    for key, value in policies.parse_options(text).items():
        name, dot, option = key.rpartition(".")
        if not dot or name not in names:
            raise flags.ValidationError(
                f"--policy_opts: {key!r} must be policy.key with policy one of {names}")
        by_policy[name][option] = value
    return by_policy
