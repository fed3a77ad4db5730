"""`--variants`: the setups `compare` runs every policy under (`experiments.compare`), and
`sweep` sweeps every policy under (`experiments.sweep`).

`--variants=LABEL:key=value;key=value,LABEL2:key=value` names setups (variants),
each the command's own flags with those flags set otherwise: a key is a run flag's
name without `--` (`router`, `num_replicas`, `prefill_replicas`, `decode_replicas`,
`bucket_ladder`, `step_padding`, `max_num_tokens`, ...), a value is what that flag
takes. Variants are separated by `,` and one variant's settings by `;` (quote the
flag in a shell), so a value holds neither; `LABEL:` alone is the command's own
setup. A label names a folder (letters, digits, `_`, `+`, `-`).

`--variants_file=PATH` names the same setups in a JSON file, an object of labels
each holding an object of settings, where a value may hold `,` and `;`:

    {"rr": {"router": "round_robin"},
     "dis": {"prefill_replicas": 1, "decode_replicas": 1},
     "ca": {"router": "cache_aware", "router_opts": "a=1,b=2"}}

A number or `true`/`false` stands for its text, a list of strings for those strings
joined by `,` (a list flag's text). The file is checked as `--variants` is, and
its errors name the file, the variant and the key. The two flags do not go together
(JSON because the project has no YAML parser among its dependencies).

Every variant runs on the one workload the command's flags build, so a key that
changes the workload (`WORKLOAD_KEYS`: the workload flags, `seed`, and `model`,
`max_model_len` and `engine`, which set the prompts' token ids and lengths) is
refused. `variant_specs` resolves every variant to its `RunSpec` through the same
`experiments.flags.spec_from_flags` as the command's own flags, so a variant's
values are checked as the flags are; a bad key or value is one line naming the
variant and the key. `Setup` is one setup a comparison runs (a variant, or the
command's own flags without `--variants`); `fit_setups` fills in their `fit:K`
ladders from one pilot.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from absl import app, flags

from experiments import flags as run_flags
from experiments.policy_flags import LABEL, LabeledPolicy
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.requests.request import Request
from orca_jax.runner.bucket_pilot import (
    BucketFit,
    PilotPolicy,
    needs_fit,
    token_sizes,
    with_fitted_buckets,
)
from orca_jax.runner.build import check_policies, scheduler_config
from orca_jax.runner.settings import effective_settings
from orca_jax.runner.spec import RunSpec, WorkloadSpec
from orca_jax.runner.sweep import variant_settings

flags.DEFINE_list("variants", [], "Setups to run every policy of --policies under, on the one "
                  "workload with one bucket pilot: LABEL:key=value;key=value,LABEL2:... (quote "
                  "it in a shell; a value holds no ',' or ';'), each key a run flag's name "
                  "that the variant sets otherwise (router, num_replicas, prefill_replicas, "
                  "decode_replicas, bucket_ladder, step_padding, max_num_tokens, ...); "
                  "'LABEL:' alone is the command's own setup. E.g. --num_replicas=2 "
                  "--variants=rr:router=round_robin,ca:router=cache_aware, or "
                  "--variants='co:num_replicas=2,dis:prefill_replicas=1;decode_replicas=1'. "
                  "Rows (compare) and curves (sweep) are POLICY@LABEL, folders "
                  "OUT_DIR/LABEL/POLICY. Keys that change the workload (its flags, seed, "
                  "model, max_model_len, engine) are refused.")
flags.DEFINE_string("variants_file", None, "The setups of --variants from a JSON file (instead "
                    "of --variants): an object of labels, each an object of settings, e.g. "
                    '{"rr": {"router": "round_robin"}, "dis": {"prefill_replicas": 1, '
                    '"decode_replicas": 1}}; a value may hold \',\' and \';\'.')

# Flags a variant may not set: each would build another workload (requests, prompt token
# ids or their context), and every variant runs on the one the command's flags build.
WORKLOAD_KEYS = frozenset(
    {flag for flag, fields in run_flags.FIELD_FLAGS.items()
     if any(part is WorkloadSpec for part, _ in fields)}
    | {"seed", "model", "max_model_len", "engine"})
# The flags a variant may set: every spec field's flag but the workload's, and the ladder.
VARIANT_KEYS = frozenset(set(run_flags.FIELD_FLAGS) - WORKLOAD_KEYS | {"bucket_ladder"})


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setup of `--variants` (or `--variants_file`): its label and the flags it sets
    (flag -> text)."""

    label: str
    settings: dict[str, str]
    source: str = "--variants"  # where it was given, for its errors: the flag (and file)


def _checked_key(source: str, label: str, key: str) -> str:
    """A variant's key (without `--`), if a variant may set it.

    Raises:
      app.UsageError: the key changes the workload or is no run flag (naming the variant).
    """
    key = key.strip().removeprefix("--")
    if key in WORKLOAD_KEYS:
        raise app.UsageError(f"{source}: {label}: {key} changes the workload, which every "
                             f"variant shares; give it as the command's --{key}")
    if key not in VARIANT_KEYS:
        raise app.UsageError(f"{source}: {label}: {key} is not a run flag a variant can set "
                             f"(one of {', '.join(sorted(VARIANT_KEYS))})")
    return key


def parse_variants(items: Sequence[str]) -> list[Variant]:
    """The variants of `--variants` (its items, split at ','), keys checked.

    Raises:
      app.UsageError: an item is not LABEL:key=value;..., a label repeats or names no
        folder, a key is no run flag or changes the workload (naming variant and key).
    """
    variants: list[Variant] = []
    for item in items:
        label, colon, rest = item.strip().partition(":")
        if not colon or not LABEL.fullmatch(label):
            raise app.UsageError(f"--variants: {item!r} must be LABEL:key=value;key=value "
                                 "(LABEL letters, digits, _, + or -; a value holds no ',' "
                                 "or ';')")
        if any(v.label == label for v in variants):
            raise app.UsageError(f"--variants: label {label!r} is given twice")
        settings: dict[str, str] = {}
        for setting in filter(None, (s.strip() for s in rest.split(";"))):
            key, eq, value = setting.partition("=")
            if not eq:
                raise app.UsageError(f"--variants: {label}: {setting!r} must be key=value")
            settings[_checked_key("--variants", label, key)] = value.strip()
        variants.append(Variant(label, settings))
    return variants


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (json keeps the last)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"{key!r} is given twice")
        seen[key] = value
    return seen


def _flag_text(value: Any) -> Optional[str]:
    """A JSON value as its flag's text: a string as it is, a number or bool as the flag
    reads it, a list of strings or numbers joined by ','; None for anything else."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float))
                                       and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    return None


def read_variants_file(path: str) -> list[Variant]:
    """The variants of `--variants_file=PATH`: a JSON object of labels, each an object of
    settings (key -> value), keys checked as `parse_variants` checks them.

    Raises:
      app.UsageError: the file does not read or is not such an object, a label names no
        folder or repeats, a key is no run flag or changes the workload, a value is not
        text, a number, a bool or a list of those (one line naming file, variant and key).
    """
    source = f"--variants_file={path}"
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f, object_pairs_hook=_unique_keys)
    except OSError as e:
        raise app.UsageError(f"{source}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise app.UsageError(f"{source}: line {e.lineno}, column {e.colno}: not JSON "
                             f"({e.msg})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise app.UsageError(f"{source}: {e}") from None
    if not isinstance(document, dict) or not document:
        raise app.UsageError(f"{source}: must be a JSON object of labels, each an object of "
                             'settings, e.g. {"rr": {"router": "round_robin"}}')
    variants: list[Variant] = []
    for label, settings in document.items():
        if not LABEL.fullmatch(label):
            raise app.UsageError(f"{source}: label {label!r} must be letters, digits, _, + "
                                 "or - (it names a folder)")
        if not isinstance(settings, dict):
            raise app.UsageError(f"{source}: {label}: must be an object of settings "
                                 f'(key: value), not {json.dumps(settings)}')
        checked: dict[str, str] = {}
        for key, value in settings.items():
            key = _checked_key(source, label, key)
            text = _flag_text(value)
            if text is None:
                raise app.UsageError(f"{source}: {label}: {key}: {json.dumps(value)} is not "
                                     "a flag's value (text, a number, true/false or a list)")
            checked[key] = text
        variants.append(Variant(label, checked, source))
    return variants


def variants_from_flags() -> list[Variant]:
    """The variants of `--variants` or `--variants_file` (none without either).

    Raises:
      app.UsageError: both flags are given, or their variants are refused.
    """
    FLAGS = run_flags.FLAGS
    if FLAGS.variants and FLAGS.variants_file is not None:
        raise app.UsageError("--variants and --variants_file: give the variants one way, "
                             "not both")
    if FLAGS.variants_file is not None:
        return read_variants_file(FLAGS.variants_file)
    return parse_variants(FLAGS.variants)


def variant_specs(variants: Sequence[Variant]) -> dict[str, RunSpec]:
    """Each variant's RunSpec: `spec_from_flags` with its settings set on the flags (the
    flags are as they were afterwards).

    Raises:
      app.UsageError: a value its flag or the spec refuses, naming variant and key.
    """
    FLAGS = run_flags.FLAGS
    specs = {}
    for variant in variants:
        saved = {key: (FLAGS[key].value, FLAGS[key].present) for key in variant.settings}
        try:
            for key, value in variant.settings.items():
                try:
                    FLAGS[key].parse(value)
                except (flags.Error, ValueError) as e:
                    raise app.UsageError(f"{variant.source}: {variant.label}: {key}={value}: "
                                         f"{e}") from None
            try:
                FLAGS.validate_all_flags()
                specs[variant.label] = run_flags.spec_from_flags()
            except (flags.Error, app.UsageError, ValueError) as e:
                raise app.UsageError(f"{variant.source}: {variant.label}: {e}") from None
        finally:
            for key, (value, present) in saved.items():
                FLAGS[key].value, FLAGS[key].present = value, present
    return specs


@dataclasses.dataclass(frozen=True)
class Setup:
    """One setup the policies run under: the command's own flags, or a `--variants` one."""

    variant: Optional[str]  # its --variants label; None: the command's flags, no variants
    spec: RunSpec
    source: str = "--variants"  # where the variant was given, for its errors

    def row_label(self, policy_label: str) -> str:
        """A policy's name under this setup: its label, and `@VARIANT` under a variant."""
        return policy_label if self.variant is None else f"{policy_label}@{self.variant}"

    def folder(self, out: str, policy_label: str) -> str:
        """A policy's folder under this setup: OUT/POLICY, or OUT/VARIANT/POLICY."""
        return os.path.join(out, *(() if self.variant is None else (self.variant,)),
                            policy_label)


def command_setups() -> tuple[RunSpec, list[Setup]]:
    """The command's own spec and the setups it runs, each variant checked as resolved.

    A variant is its own settings on the command's flags, checked as such (`variant_specs`):
    a `tp=8` variant of a model the command's own `--tp=1` cannot hold runs. Where the
    command's own flags make no valid setup but every variant does, the command's spec is
    the first variant's: its workload is every variant's (a variant may not change it),
    and its pilots fit the ladder every variant compiles (`fit_setups`).

    Raises:
      app.UsageError: the command's flags are refused and no variant changes what refused
        them (their own error, as without variants), or a variant is refused (naming it
        and the key).
    """
    variants = variants_from_flags()
    base_error: Optional[app.UsageError] = None
    try:
        spec: Optional[RunSpec] = run_flags.spec_from_flags()
    except app.UsageError as error:
        if not variants:
            raise
        spec, base_error = None, error
    if not variants:
        assert spec is not None
        return spec, [Setup(None, spec)]
    specs: dict[str, RunSpec] = {}
    errors: list[app.UsageError] = []
    for variant in variants:  # each alone: which of them the command's error is not fixed by
        try:
            specs.update(variant_specs([variant]))
        except app.UsageError as error:
            errors.append(error)
    if errors:
        if base_error is not None and len(errors) == len(variants) and all(
                str(error).endswith(str(base_error)) for error in errors):
            raise base_error  # the command's own flags, whatever the variants set
        raise errors[0]
    setups = [Setup(variant.label, specs[variant.label], variant.source)
              for variant in variants]
    return (setups[0].spec if spec is None else spec), setups


def check_setups(setups: Sequence[Setup], entries: Sequence[LabeledPolicy]
                 ) -> dict[str, dict[str, Any]]:
    """Builds every policy under every setup (its router too), before anything runs: a typo
    in the last one fails now and leaves no folder.

    Returns:
      Each row's (`Setup.row_label`) effective settings (`runner.settings`).

    Raises:
      PolicyLoadError: a policy, a knob or a router does not load (under a variant, the
        line names it).
    """
    settings: dict[str, dict[str, Any]] = {}
    for setup in setups:
        try:
            config = scheduler_config(setup.spec)  # its own KV pool, on its own GPUs
            built = check_policies(setup.spec, config,
                                   [(entry.spec, entry.options) for entry in entries])
        except PolicyLoadError as e:
            if setup.variant is None:
                raise
            raise PolicyLoadError(f"{setup.source}: {setup.variant}: {e}") from None
        except ValueError as e:  # its settings, as resolved, refused (a pool, a fit)
            if setup.variant is None:
                raise
            raise app.UsageError(f"{setup.source}: {setup.variant}: {e}") from None
        for entry, policy in zip(entries, built):
            settings[setup.row_label(entry.label)] = effective_settings(policy, config)
    return settings


def caption_note(spec: RunSpec, setups: Sequence[Setup]) -> str:
    """The figure caption's note on the variants (empty without them): each label with
    what it sets (`runner.sweep.variant_settings`), so that the caption, which speaks of
    the command's own setup, misleads no one about the bars or curves."""
    if setups[0].variant is None:
        return ""
    notes = []
    for setup in setups:
        sets = variant_settings(spec, setup.spec)
        notes.append(f"{setup.variant}: " + (", ".join(f"{key}={value}"
                                                       for key, value in sets.items())
                                              or "the command's own setup"))
    return "; variants " + "; ".join(notes)


def ladder_lines(setups: Sequence[Setup]) -> list[str]:
    """A line when variants run different bucket sizes (a variant set the ladder or the
    budget): the compiled-steps line speaks of one ladder."""
    sizes = {setup.variant: token_sizes(setup.spec) for setup in setups}
    if len(set(sizes.values())) < 2:
        return []
    return ["note: the variants run different bucket sizes: "
            + "; ".join(f"{label}: {len(s)} sizes up to {s[-1]}" for label, s in sizes.items())
            + " (each run's config.json lists them)"]


def pilot_played(spec: RunSpec, setup: Setup) -> bool:
    """Whether `fit_setups`'s pilots played this very setup (their ragged figures are then
    its policies' own): it has a ladder or budget of its own (so pilots of its own), or
    it sets nothing the command's setup does not."""
    limits = setup.spec.limits
    if (limits.bucket_ladder, limits.max_num_tokens) != (spec.limits.bucket_ladder,
                                                          spec.limits.max_num_tokens):
        return True
    return dataclasses.replace(setup.spec, limits=dataclasses.replace(
        limits, token_buckets=spec.limits.token_buckets)) == spec


def fit_setups(spec: RunSpec, setups: Sequence[Setup], requests: Sequence[Request],
               policies: Sequence[PilotPolicy]) -> list[tuple[Setup, Optional[BucketFit]]]:
    """Every setup with its `fit:K` sizes filled in, from one set of pilots for all of them.

    The pilots (one per compared policy, `policies`) play the command's own setup
    (`spec`, whatever the variants change: its cluster, router, engine settings) and
    every setup that fits the same ladder under the same token budget takes its sizes,
    so every variant compiles the very same steps: a variant's results differ by what
    it sets, not by a ladder fitted to it. Only a setup whose ladder or budget differs
    (whose steps differ anyway) gets pilots of its own.
    """
    pilots: dict[tuple[Optional[str], int], tuple[RunSpec, Optional[BucketFit]]] = {}
    fitted = []
    for setup in setups:
        limits = setup.spec.limits
        key = (limits.bucket_ladder, limits.max_num_tokens)
        if key not in pilots and needs_fit(setup.spec):
            own = key == (spec.limits.bucket_ladder, spec.limits.max_num_tokens)
            pilots[key] = with_fitted_buckets(spec if own else setup.spec, requests,
                                              policies=policies, progress=True)
            fit = pilots[key][1]
            assert fit is not None
            print(("" if own else f"variant {setup.variant}: ") + fit.lines())
        if not needs_fit(setup.spec):
            fitted.append((setup, None))
            continue
        sizes, fit = pilots[key][0].limits.token_buckets, pilots[key][1]
        fitted.append((dataclasses.replace(setup, spec=dataclasses.replace(
            setup.spec, limits=dataclasses.replace(limits, token_buckets=sizes))), fit))
    return fitted
