"""The flags of entry points that run several policies (compare, sweep).

`--policies` lists policy specs; `--policy_opts` (shared with run) takes
`policy.key=value,...`, with `policy` as named in `--policies`.
"""

from __future__ import annotations

import os
from collections import defaultdict

from absl import flags

flags.DEFINE_list("policies", ["static", "orca"], "Policies to compare (names or plugin paths).")


def policy_label(spec: str) -> str:
    """A short name for a policy spec: `orca`, or the class of `path/file.py:Class`."""
    return os.path.splitext(os.path.basename(spec.rpartition(":")[2] or spec))[0]


def options_by_policy(text: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Splits `policy.key=value,...` into each policy's own options.

    `policy` is a spec as given in `--policies` or its label (`policy_label`), so
    a plugin loaded by path takes `Class.key=value`. Returns options by spec.
    """
    spec_of = {policy_label(name): name for name in names}
    spec_of.update({name: name for name in names})
    by_policy: dict[str, dict[str, str]] = defaultdict(dict)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        # The key's last dot splits policy from option; a path spec may hold dots itself.
        name, dot, option = key.strip().rpartition(".")
        if not sep or not dot or name not in spec_of:
            raise flags.ValidationError(
                f"--policy_opts: {item!r} must be policy.key=value with policy one of "
                f"{sorted(set(spec_of))}")
        by_policy[spec_of[name]][option] = value.strip()
    return by_policy
