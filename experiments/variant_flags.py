"""`--variants`: the setups `compare` runs every policy under (`experiments.compare`).

`--variants=LABEL:key=value;key=value,LABEL2:key=value` names setups (variants),
each the command's own flags with those flags set otherwise: a key is a run flag's
name without `--` (`router`, `num_replicas`, `prefill_replicas`, `decode_replicas`,
`bucket_ladder`, `step_padding`, `max_num_tokens`, ...), a value is what that flag
takes. Variants are separated by `,` and one variant's settings by `;` (quote the
flag in a shell), so a value holds neither; `LABEL:` alone is the command's own
setup. A label names a folder (letters, digits, `_`, `+`, `-`).

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
import os
from typing import Optional, Sequence

from absl import app, flags

from experiments import flags as run_flags
from experiments.policy_flags import LABEL
from orca_jax.core.requests.request import Request
from orca_jax.runner.bucket_pilot import BucketFit, needs_fit, token_sizes, with_fitted_buckets
from orca_jax.runner.spec import RunSpec, WorkloadSpec

flags.DEFINE_list("variants", [], "Setups to run every policy of --policies under, on the one "
                  "workload with one bucket pilot: LABEL:key=value;key=value,LABEL2:... (quote "
                  "it in a shell; a value holds no ',' or ';'), each key a run flag's name "
                  "that the variant sets otherwise (router, num_replicas, prefill_replicas, "
                  "decode_replicas, bucket_ladder, step_padding, max_num_tokens, ...); "
                  "'LABEL:' alone is the command's own setup. E.g. --num_replicas=2 "
                  "--variants=rr:router=round_robin,ca:router=cache_aware, or "
                  "--variants='co:num_replicas=2,dis:prefill_replicas=1;decode_replicas=1'. "
                  "Rows are POLICY@LABEL, folders OUT_DIR/LABEL/POLICY. Keys that change "
                  "the workload (its flags, seed, model, max_model_len, engine) are refused.")

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
    """One setup of `--variants`: its label and the flags it sets (flag -> text)."""

    label: str
    settings: dict[str, str]


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
            key = key.strip().removeprefix("--")
            if not eq:
                raise app.UsageError(f"--variants: {label}: {setting!r} must be key=value")
            if key in WORKLOAD_KEYS:
                raise app.UsageError(f"--variants: {label}: {key} changes the workload, "
                                     "which every variant shares; give it as the command's "
                                     f"--{key}")
            if key not in VARIANT_KEYS:
                raise app.UsageError(f"--variants: {label}: {key} is not a run flag a "
                                     f"variant can set (one of {', '.join(sorted(VARIANT_KEYS))})")
            settings[key] = value.strip()
        variants.append(Variant(label, settings))
    return variants


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
                    raise app.UsageError(f"--variants: {variant.label}: {key}={value}: "
                                         f"{e}") from None
            try:
                FLAGS.validate_all_flags()
                specs[variant.label] = run_flags.spec_from_flags()
            except (flags.Error, app.UsageError, ValueError) as e:
                raise app.UsageError(f"--variants: {variant.label}: {e}") from None
        finally:
            for key, (value, present) in saved.items():
                FLAGS[key].value, FLAGS[key].present = value, present
    return specs


@dataclasses.dataclass(frozen=True)
class Setup:
    """One setup the policies run under: the command's own flags, or a `--variants` one."""

    variant: Optional[str]  # its --variants label; None: the command's flags, no variants
    spec: RunSpec

    def row_label(self, policy_label: str) -> str:
        """A policy's name under this setup: its label, and `@VARIANT` under a variant."""
        return policy_label if self.variant is None else f"{policy_label}@{self.variant}"

    def folder(self, out: str, policy_label: str) -> str:
        """A policy's folder under this setup: OUT/POLICY, or OUT/VARIANT/POLICY."""
        return os.path.join(out, *(() if self.variant is None else (self.variant,)),
                            policy_label)


def ladder_lines(setups: Sequence[Setup]) -> list[str]:
    """A line when variants run different bucket sizes (a variant set the ladder or the
    budget): the compiled-steps line speaks of one ladder."""
    sizes = {setup.variant: token_sizes(setup.spec) for setup in setups}
    if len(set(sizes.values())) < 2:
        return []
    return ["note: the variants run different bucket sizes: "
            + "; ".join(f"{label}: {len(s)} sizes up to {s[-1]}" for label, s in sizes.items())
            + " (each run's config.json lists them)"]


def fit_setups(spec: RunSpec, setups: Sequence[Setup], requests: Sequence[Request]
                ) -> list[tuple[Setup, Optional[BucketFit]]]:
    """Every setup with its `fit:K` sizes filled in, from one pilot for all of them.

    The pilot plays the command's own setup (`spec`, whatever the variants change: its
    cluster, router, engine settings) and every setup that fits the same ladder under
    the same token budget takes its sizes, so every variant compiles the very same
    steps: a variant's results differ by what it sets, not by a ladder fitted to it.
    Only a setup whose ladder or budget differs (whose steps differ anyway) gets a
    pilot of its own.
    """
    pilots: dict[tuple[Optional[str], int], tuple[RunSpec, Optional[BucketFit]]] = {}
    fitted = []
    for setup in setups:
        limits = setup.spec.limits
        key = (limits.bucket_ladder, limits.max_num_tokens)
        if key not in pilots and needs_fit(setup.spec):
            own = key == (spec.limits.bucket_ladder, spec.limits.max_num_tokens)
            pilots[key] = with_fitted_buckets(spec if own else setup.spec, requests,
                                              progress=True)
            fit = pilots[key][1]
            assert fit is not None
            print(("" if own else f"variant {setup.variant}: ") + fit.lines())
        if not needs_fit(setup.spec):
            fitted.append((setup, None))
            continue
        sizes, fit = pilots[key][0].limits.token_buckets, pilots[key][1]
        fitted.append((Setup(setup.variant, dataclasses.replace(
            setup.spec, limits=dataclasses.replace(limits, token_buckets=sizes))), fit))
    return fitted
