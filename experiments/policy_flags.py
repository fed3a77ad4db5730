"""The flags of entry points that run several policies (compare, sweep).

`--policies` lists policy specs, each optionally under a label
(`small=vllm,big=vllm`); `--policy_opts` (shared with run) takes
`label.key=value,...`. The label is the variant's name everywhere: its folder,
its row of the table, the `policy` field of its summary.json, its curve of a
sweep. Without one, a policy's label is its name: the registered name, or the
`name` of a plugin loaded by path (the class name, lower-cased, unless the
class registers or sets another).

`resolve_policies` loads every policy with its options up front, so a typo in
the last policy's knob fails before the first run starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import defaultdict
from typing import Mapping

from absl import flags

from experiments.list_flags import registered_names
from orca_jax.core.api.policy import PolicyLoadError, resolve_policy_class

flags.DEFINE_list("policies", ["static", "orca"], "Policies to compare: registered names, "
                  "package.module:Class or path/to/file.py:Class, each optionally under a "
                  "label, LABEL=SPEC (small=vllm,big=vllm runs vllm twice, with "
                  "--policy_opts=small.max_num_seqs=8). The label (default: the policy's "
                  "name) names its folder, its table row and its --policy_opts prefix. "
                  + registered_names("policies"))

LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_+-]*")  # a folder name and an options prefix


@dataclasses.dataclass(frozen=True)
class LabeledPolicy:
    """One entry of `--policies`: a policy spec under its label, with its options."""

    label: str  # its name in folders, tables and summaries, and its --policy_opts prefix
    spec: str  # registered name, package.module:Class or path/to/file.py:Class
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)


def policy_label(spec: str) -> str:
    """A short name for a policy spec: `orca`, or the class of `path/file.py:Class`."""
    return os.path.splitext(os.path.basename(spec.rpartition(":")[2] or spec))[0]


def _split_label(item: str) -> tuple[str | None, str]:
    """`label=spec` -> (label, spec); a bare spec -> (None, spec)."""
    label, sep, spec = item.partition("=")
    if not sep:
        return None, item
    if not LABEL.fullmatch(label):
        raise PolicyLoadError(f"--policies: label {label!r} of {item!r} must be letters, "
                              "digits, _, + or - (it names a folder)")
    if not spec:
        raise PolicyLoadError(f"--policies: {item!r} gives label {label!r} no policy")
    return label, spec


def resolve_policies(items: list[str], options_text: str) -> list[LabeledPolicy]:
    """The labeled policies of `--policies`, each with its `--policy_opts`.

    Every policy class is resolved here (an unknown policy or a bad plugin file fails
    now); the options are only split, `orca_jax.runner.build.check_policies` builds them.

    Args:
      items: `--policies`, each `spec` or `label=spec`.
      options_text: `--policy_opts`, `prefix.key=value,...`; a prefix is a label, a spec
        that appears once in `items`, or the class name of such a `file.py:Class` spec.

    Raises:
      PolicyLoadError: a policy does not resolve, two share a label, or an option's
        prefix names no policy (the message names it).
    """
    if not items:
        raise PolicyLoadError("--policies is empty")
    entries: list[tuple[str, str]] = []
    for item in items:
        label, spec = _split_label(item.strip())
        cls = resolve_policy_class(spec)
        entries.append((label or cls.name, spec))
    labels = [label for label, _ in entries]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        # The example names the variants' specs, e.g. `a=vllm,b=vllm` for two vllm runs.
        specs = [spec for label, spec in entries if label == repeated[0]]
        raise PolicyLoadError(f"--policies={','.join(items)}: label {repeated[0]!r} is given "
                              f"twice; give each variant its own, e.g. a={specs[0]},"
                              f"b={specs[1]}")
    by_label = _split_options(options_text, entries)
    return [LabeledPolicy(label, spec, by_label.get(label, {})) for label, spec in entries]


def _split_options(text: str, entries: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Splits `prefix.key=value,...` into each label's options (see `resolve_policies`)."""
    label_of = {label: label for label, _ in entries}
    specs = [spec for _, spec in entries]
    for label, spec in entries:
        if specs.count(spec) == 1:  # a spec, or a plugin's class name, if it is unambiguous
            label_of.setdefault(spec, label)
            label_of.setdefault(policy_label(spec), label)
    by_label: dict[str, dict[str, str]] = defaultdict(dict)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        # The key's last dot splits policy from option; a path spec may hold dots itself.
        prefix, dot, option = key.strip().rpartition(".")
        if not sep or not dot or prefix not in label_of:
            raise PolicyLoadError(
                f"--policy_opts: {item!r} must be label.key=value with label one of "
                f"{[label for label, _ in entries]}")
        by_label[label_of[prefix]][option] = value.strip()
    return by_label


def options_by_policy(text: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Splits `policy.key=value,...` into each policy's own options, by spec.

    `policy` is a spec as given in `names` or its label; for a caller whose specs
    carry no labels (calibrate).

    Raises:
      flags.ValidationError: an option's prefix names no policy.
    """
    try:
        resolved = resolve_policies(names, text)
    except PolicyLoadError as e:
        raise flags.ValidationError(str(e)) from None
    return {entry.spec: dict(entry.options) for entry in resolved}
