"""The run-plumbing flags shared by experiments.run, .compare and .sweep.

Flags are plumbing only (engine, model, workload, limits, output); experiment
knobs live on policies (`--policy_opts`). `spec_from_flags()` resolves them into
an `orca_jax.runner.spec.RunSpec`. The flags renamed in 0.2 (`--max_batch_size`,
`--token_budget`) still set their new flags, with a warning line.

The spec is the one source: every documented field of a spec part is a flag
(`field_flags` walks them; `FLAGLESS_FIELDS` lists the rest), defined from the
field: its kind, its default (None where `spec.COMMAND_DEFAULTS` gives the
engine's) and its help (the field's doc, the presets or registered names its
value may be, the engine's defaults). `flag_spec_mismatches` names any flag
that no longer says what its field does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import typing
import warnings
from typing import Any, Optional

from absl import app, flags

import policies  # noqa: F401  (registers the built-in routers that --router's help names)
from experiments import list_flags
from experiments.cli_errors import clean_errors, parse_flags, run_command  # noqa: F401 (entry points' API)
from orca_jax.cluster.planning import registered_planners
from orca_jax.cluster.rebalancing import registered_rebalancers
from orca_jax.cluster.routing import registered_routers
from orca_jax.core.step.bucket_fit import capped_fit_ladder, ladder_gap_error, parse_fit_ladder
from orca_jax.core.step.packing import ladder_token_sizes
from orca_jax.results.latest_link import DEFAULT_OUT_DIR, fresh_out_dir, point_latest
from orca_jax.runner.spec import (
    COMMAND_DEFAULTS,
    ENGINES,
    LENGTH_COLUMNS,
    ClusterSpec,
    JaxEngineSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
    field_doc,
)
from orca_jax.runner.spec_caps import check_step_tokens
from orca_jax.runner.spec_fields import spec_field
from orca_jax.sim.engine_profiles import get_engine_profile
from orca_jax.workloads.synthetic import parse_length_spec

flags.adopt_module_key_flags(list_flags)  # --list_policies, ... on every command of the run flags

# Python hides a DeprecationWarning raised outside __main__; a command shows the library's
# own (an old policy option name, an old view attribute a plugin reads), once each.
warnings.filterwarnings("default", message=r".* is deprecated; use ", category=DeprecationWarning)

flags.DEFINE_enum("engine", "jax", list(ENGINES), "Engine: the real JAX model (jax) or the "
                  "cost-model simulator (sim).")
# Not --profile_file: absl.app owns that name (a pstats dump of the process).
flags.DEFINE_string("compile_cache", None, "jax: folder of JAX's persistent compilation cache "
                    "(default: $XDG_CACHE_HOME/orca_jax/jax, else ~/.cache/orca_jax/jax); a "
                    "second run with the same model and buckets loads its compiled steps from "
                    "there. 'none' turns it off.")
flags.DEFINE_string("profile_store", None, "jax, --clock=profiled: folder of the profiled "
                    "clock's tables, one per machine, model, dtype, buckets, attention and page "
                    "geometry (default: $XDG_CACHE_HOME/orca_jax/profiled_clock, else "
                    "~/.cache/orca_jax/profiled_clock); a later command of the same setup "
                    "reads its table instead of timing steps again, so both price steps alike "
                    "(--profile_table=fresh re-times it). 'none' keeps no tables.")
flags.DEFINE_integer("num_processes", 1, "jax: processes of one run (jax.distributed); the "
                     "--tp mesh spans their devices and every process runs the same steps. "
                     "Every process gets the same flags but --process_id.", lower_bound=1)
flags.DEFINE_integer("process_id", 0, "jax, --num_processes > 1: this process's rank; process 0 "
                     "writes --out_dir, process k writes OUT_DIR.processK.", lower_bound=0)
flags.DEFINE_string("coordinator", None, "jax, --num_processes > 1: HOST:PORT of process 0's "
                    "coordinator (the same on every process).")
flags.DEFINE_integer("max_batch_size", None, "Deprecated: use --max_num_seqs.", lower_bound=1)
flags.DEFINE_integer("token_budget", None, "Deprecated: use --max_num_tokens.", lower_bound=1)
flags.DEFINE_list("buckets", None, "Step token sizes to pad to, ending at --max_num_tokens "
                  "(default: --bucket_ladder).")
flags.DEFINE_string("bucket_ladder", "auto", "Step token sizes by rule, unless --buckets gives "
                    "them: pow2 (powers of two), geometric:R (each about R times the last, e.g. "
                    "1.41), step:N (multiples of N), or fit:K: the at most K sizes (multiples of "
                    "8), none over 2x the one below, that pad least the steps of pilot runs: the "
                    "simulator on the same whole workload, limits, model, hardware and cluster, "
                    "priced ragged on a step:8 ladder, one pilot per policy that shares the "
                    "ladder (run: its policy; compare and sweep: every policy of --policies, so "
                    "every policy compared drives the same sizes); config.json records the "
                    "sizes (repeat with --buckets=...) and the pilots. Each tops out at "
                    "--max_num_tokens; on --engine=sim no size may be over 2x the one below "
                    "(without --cost_fit). auto: fit:16 on --engine=sim (fewer under a budget "
                    "below 128: one per multiple of 8; pow2 with --cost_fit, which prices only "
                    "its own buckets), pow2 on --engine=jax (each size is a "
                    "compile there, and its clock is not the simulator's).")
flags.DEFINE_string("out_dir", DEFAULT_OUT_DIR, "Output directory. Not given: a fresh folder "
                    "per command, runs/<command>-<YYYYmmdd-HHMMSS>, and runs/latest a link to "
                    "the newest, so no command replaces another's results. Given: a run "
                    "replaces that folder's results whole.")
flags.DEFINE_string("policy_opts", "", "Policy knobs: key=value,... (in compare and sweep: "
                    "label.key=value, label as named in --policies). A knob named like a "
                    "scheduler limit (max_num_seqs, max_num_tokens, num_kv_pages, "
                    "max_model_len) may not exceed the run's flag of that name: that is an "
                    "error, not a silent cap.")

# The spec parts whose documented fields (`spec._knob`) are flags, and the fields that are
# not (with where they are set instead). Every other field of a part is a flag.
SPEC_PARTS = (WorkloadSpec, JaxEngineSpec, SimEngineSpec, LimitsSpec, ClusterSpec, RunSpec)
FLAGLESS_FIELDS = {
    "kind": "--engine names the engine part",
    "token_buckets": "--buckets (a list) or --bucket_ladder's rule give the sizes",
    "bucket_ladder": "--bucket_ladder resolves 'auto' by engine (AUTO_LADDER)",
    "kv_layout": "set in code: the vLLM-memory reproduction's buddy baselines",
    "trace_at_rate": "--rate given with a trace (spec_from_flags)",
    "workload": "a part", "engine": "a part", "limits": "a part", "cluster": "a part",
}
# Flags named otherwise than their field (the names of 0.1's flags).
FLAG_OF_FIELD = {"arrival": "workload", "num_prefill_replicas": "prefill_replicas",
                 "num_decode_replicas": "decode_replicas"}
# absl's bounds on a flag's value (the spec checks its own the same or tighter).
LOWER_BOUNDS: dict[str, float] = {
    "num_requests": 1, "rate": 0.0, "cv": 0.0, "num_prefixes": 1, "prefix_zipf": 0.0, "tp": 1,
    "pp": 1,
    "step_time_ms": 0.0, "max_num_seqs": 1, "max_num_tokens": 1, "num_kv_pages": 1,
    "page_size": 1, "max_model_len": 2, "no_progress_steps": 1, "num_replicas": 1,
    "num_prefill_replicas": 0, "num_decode_replicas": 0, "kv_link_max_concurrent": 1,
    "seed": 0, "trace_block_size": 1, "program_fanout": 1, "program_count": 1,
    "kv_pin_s": 0.0, "min_replicas": 1, "trace_repeat": 1, "max_replicas": 1,
    "replica_startup_s": 0.0}
# Where a field's `registry` names its values.
REGISTRIES = {"router": lambda: sorted(registered_routers()),
              "rebalancer": lambda: sorted(registered_rebalancers()),
              "planner": lambda: sorted(registered_planners())}


def field_flags() -> dict[str, tuple[tuple[type, str], ...]]:
    """Flag name -> the spec fields it sets, by walking `SPEC_PARTS` (a setting both engines
    have, model and tp, is one flag of two fields)."""
    found: dict[str, list[tuple[type, str]]] = {}
    for part in SPEC_PARTS:
        for field in dataclasses.fields(part):
            if field.name not in FLAGLESS_FIELDS:
                found.setdefault(FLAG_OF_FIELD.get(field.name, field.name), []).append(
                    (part, field.name))
    return {flag: tuple(fields) for flag, fields in found.items()}


def flag_default(fields: tuple[tuple[type, str], ...]) -> Any:
    """The default a flag of `fields` must have: None where the engine's column of
    `COMMAND_DEFAULTS` gives it, else the fields' default (the same on each)."""
    name = fields[0][1]
    if any(name in column for column in COMMAND_DEFAULTS.values()):
        return None
    defaults = {repr(spec_field(part, field).default) for part, field in fields}
    if len(defaults) != 1:
        raise ValueError(f"fields {[f'{p.__name__}.{f}' for p, f in fields]} disagree on their "
                         f"default ({sorted(defaults)}); one flag cannot have both")
    return spec_field(*fields[0]).default


def flag_help(fields: tuple[tuple[type, str], ...]) -> str:
    """The help a flag of `fields` must have: each field's doc (led by its engine where only
    one engine has it), the presets or registered names its value may be, and the
    engine's default where it depends on the engine."""
    docs = {part: field_doc(part, name) for part, name in fields}
    undocumented = [f"{part.__name__}.{name}" for part, name in fields if not docs[part]]
    if undocumented:
        raise ValueError(f"{undocumented[0]} has no doc (runner.spec._knob) for its flag's "
                         "help: document it, or list it in FLAGLESS_FIELDS")
    engines = {JaxEngineSpec: "jax", SimEngineSpec: "sim"}
    texts = [doc["help"] for doc in docs.values()]
    if len(set(texts)) > 1 or (len(fields) == 1 and fields[0][0] in engines):
        texts = [f"{engines[part]}: {doc['help']}" for part, doc in docs.items()]
    text = " ".join(dict.fromkeys(texts))
    first = next(iter(docs.values()))
    if first["presets"]:
        text += f" Presets: {', '.join(first['presets'])}."
    if first["registry"]:
        text += f" Registered: {', '.join(REGISTRIES[first['registry']]())}."
    name = fields[0][1]
    if any(name in column for column in COMMAND_DEFAULTS.values()):
        text += " Default: " + ", ".join(f"{column[name]} on {engine}"
                                         for engine, column in COMMAND_DEFAULTS.items()) + "."
    return text


# A field's annotation as written (the spec modules postpone them), the kind of its flag.
_PLAIN_KINDS: dict[str, type] = {
    text: kind for plain, kind in (("bool", bool), ("int", int), ("float", float),
                                   ("str", str))
    for text in (plain, f"Optional[{plain}]")}


@functools.lru_cache(maxsize=None)
def _type_hints(part: type) -> dict[str, Any]:
    """`part`'s evaluated field types, once per part: `typing.get_type_hints` evaluates
    every annotation of the part each call, and defining the flags asks once per field
    (a fifth of the import of this module was that)."""
    return typing.get_type_hints(part)


def _field_kind(part: type, name: str) -> Any:
    """The type of `part`'s field `name`, `Optional` taken off. An annotation written as a
    plain `bool`, `int`, `float` or `str` (or `Optional` of one: every flag's field today)
    is read as written; evaluating the parts' annotations (`_type_hints`) cost the import
    of the run commands about 7 ms, and is left to any other."""
    kind = _PLAIN_KINDS.get(part.__dataclass_fields__[name].type)
    if kind is not None:
        return kind
    kind = _type_hints(part)[name]
    return next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)


def define_field_flag(flag: str, fields: tuple[tuple[type, str], ...]) -> None:
    """Defines `--flag` on absl's flags: its kind from the field's type (an enum where the
    field lists its choices), its default and help from the fields."""
    part, name = fields[0]
    kind = _field_kind(part, name)
    default, text = flag_default(fields), flag_help(fields)
    bound = {"lower_bound": LOWER_BOUNDS[name]} if name in LOWER_BOUNDS else {}
    if field_doc(part, name)["choices"]:
        flags.DEFINE_enum(flag, default, list(field_doc(part, name)["choices"]), text)
    elif kind is bool:
        flags.DEFINE_bool(flag, default, text)
    elif kind is int:
        flags.DEFINE_integer(flag, default, text, **bound)
    elif kind is float:
        flags.DEFINE_float(flag, default, text, **bound)
    else:
        flags.DEFINE_string(flag, default, text)


def flag_spec_mismatches(flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """Every flag of a spec field whose default or help is not what its field says, one
    line each naming the flag and the field (tests/test_flag_spec_consistency.py)."""
    found = []
    for flag, fields in field_flags().items():
        where = " and ".join(f"{part.__name__}.{name}" for part, name in fields)
        if flag not in flag_values:
            found.append(f"--{flag}: not defined, for {where} (or list it in FLAGLESS_FIELDS)")
            continue
        try:
            default, text = flag_default(fields), flag_help(fields)
        except ValueError as e:
            found.append(f"--{flag}: {e}")
            continue
        choices = field_doc(*fields[0])["choices"]
        if choices:  # DEFINE_enum leads the help with them
            text = f"<{'|'.join(choices)}>: {text}"
        if flag_values[flag].default != default:
            found.append(f"--{flag}: default {flag_values[flag].default!r}, but {where} says "
                         f"{default!r}")
        if flag_values[flag].help != text:
            found.append(f"--{flag}: help {flag_values[flag].help!r}, but {where} says "
                         f"{text!r}")
    return found


FIELD_FLAGS = field_flags()
for _flag, _fields in FIELD_FLAGS.items():
    define_field_flag(_flag, _fields)

TABLE_COLUMNS = ("policy", "num_finished", "num_rejected", "num_steps", "duration_s",
                 "throughput_req_s", "output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "latency_p50_s", "latency_p99_s",
                 "normalized_latency_mean_s", "num_preemptions", "padding_fraction",
                 "num_buckets",  # the compiled step shapes (of the ladder) beside the padding
                 "prefix_hit_rate",  # only with prefix caching active ('-' otherwise)
                 # only with slower KV tiers ('-' otherwise)
                 "kv_tiers.host.hit_tokens", "kv_tiers.host.read_bytes", "kv_stall_s_total",
                 "kv_tiers.disk.hit_tokens",
                 "goodput_req_s", "slo_attainment")  # only with an SLO set ('-' otherwise)
# Columns a table gains only where some run has them (none otherwise, not even '-').
QOE_COLUMNS = ("qoe_mean", "qoe_p10", "qoe_p50", "qoe_attainment")  # --log_token_times

# Deprecated flag -> the flag it sets now (kept for one release).
RENAMED_FLAGS = {"max_batch_size": "max_num_seqs", "token_budget": "max_num_tokens"}

FLAGS = flags.FLAGS


def _validate_length(name: str, column: str) -> None:
    def check(value: Optional[str]) -> bool:
        if value is None:
            return True
        try:
            parse_length_spec(value, default_column=column)
        except (ValueError, OSError) as e:
            raise flags.ValidationError(str(e)) from e
        return True
    flags.register_validator(name, check)


_validate_length("prompt_len", "prompt_len")
_validate_length("output_len", "output_len")
for _name, _column in LENGTH_COLUMNS.items():
    _validate_length(_name, _column)


AUTO_LADDER = {"sim": "fit:16", "jax": "pow2"}  # --bucket_ladder=auto, by engine


def _buckets(max_num_tokens: int) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(token_buckets, bucket_ladder) of the LimitsSpec: the sizes of --buckets or of a rule
    ladder, or the `fit:K` ladder the runner fits (`runner.bucket_pilot`)."""
    if FLAGS.buckets:
        if FLAGS["bucket_ladder"].present:
            raise app.UsageError("--buckets and --bucket_ladder both choose the step sizes: "
                                 "give one")
        try:
            return tuple(int(b) for b in FLAGS.buckets), None
        except ValueError:
            raise flags.ValidationError(f"--buckets={','.join(FLAGS.buckets)}: expected "
                                        "integers") from None
    ladder = FLAGS.bucket_ladder
    if ladder == "auto":
        ladder = ("pow2" if FLAGS.cost_fit or _padding_not_the_ladders()
                  else AUTO_LADDER[FLAGS.engine])
        if ladder == "pow2":
            return None, None  # the library's default: the config (and a sweep's) as before
        # fit:16 needs a budget of 128 tokens: a default must not refuse a smaller one.
        ladder = capped_fit_ladder(ladder, max_num_tokens)
    try:
        if parse_fit_ladder(ladder) is not None:
            return None, ladder  # LimitsSpec checks K against --max_num_tokens
    except ValueError as e:
        raise app.UsageError(f"--bucket_ladder: {e}") from None
    try:
        sizes = ladder_token_sizes(ladder, max_num_tokens)
    except ValueError as e:
        raise app.UsageError(f"--bucket_ladder: {e}, fit:K (K >= 1) or auto") from None
    gap = ladder_gap_error(sizes) if FLAGS.engine == "sim" and not FLAGS.cost_fit else None
    if gap is not None:  # the spec would refuse it naming --buckets, which was not given
        raise app.UsageError(f"--bucket_ladder={ladder}: {gap} on the simulator")
    return sizes, None


def _padding_not_the_ladders() -> bool:
    """Whether the simulator prices no step by its bucket: `--step_padding=ragged`, or an
    engine profile that pads its own way (vllm: its CUDA graph sizes). A ladder is then
    only the sizes the run packs to, and fitting one would cost a pilot for nothing."""
    if FLAGS.engine != "sim":
        return False
    return (FLAGS.step_padding == "ragged"
            or get_engine_profile(FLAGS.engine_profile).graph_sizes is not None)


def ladder_reason() -> str:
    """Why the run has its ladder, from the flags that chose it (`_buckets`)."""
    if FLAGS.buckets:
        return "--buckets"
    if FLAGS.bucket_ladder != "auto":
        return f"--bucket_ladder={FLAGS.bucket_ladder}"
    if FLAGS.cost_fit:
        return "--bucket_ladder=auto: pow2, as a cost fit prices only its calibrated sizes"
    if _padding_not_the_ladders():
        why = ("--step_padding=ragged" if FLAGS.step_padding == "ragged" else
               f"--engine_profile={FLAGS.engine_profile} pads steps to its engine's graph sizes")
        return f"--bucket_ladder=auto: pow2, no pilot: {why}, so no step is priced by its bucket"
    if FLAGS.engine == "jax":
        return "--bucket_ladder=auto: pow2 on the jax engine, where each size is a compile"
    return (f"--bucket_ladder=auto: {AUTO_LADDER['sim']} on the simulator, the sizes that pad "
            "the policies' own steps least")


def _take_renamed_flags() -> None:
    """Sets each new flag from its deprecated name, if given, with one warning line.

    Raises:
      app.UsageError: the old and the new name are both given, with different values.
    """
    for old, new in RENAMED_FLAGS.items():
        if not FLAGS[old].present:
            continue
        value = FLAGS[old].value
        print(f"--{old} is deprecated; use --{new}", file=sys.stderr)
        if FLAGS[new].present and FLAGS[new].value != value:
            raise app.UsageError(f"--{old}={value} and --{new}={FLAGS[new].value} disagree; "
                                 f"give only --{new}")
        FLAGS[new].value = value


def _check_router_flags() -> None:
    """Refuses --router or --router_opts given with one replica (they would do nothing)."""
    given = [f"--{name}={FLAGS[name].value}" for name in ("router", "router_opts")
             if FLAGS[name].present]
    if given and FLAGS.num_replicas == 1:
        raise app.UsageError(f"{' '.join(given)} routes between replicas, but --num_replicas=1; "
                             "give --num_replicas > 1 or drop the router flags")


ENGINE_PARTS = {"jax": JaxEngineSpec, "sim": SimEngineSpec}


def _check_engine_flags() -> None:
    """Refuses a flag given that only the other engine reads (`--noleap`, `--hardware` with
    --engine=jax; `--checkpoint`, `--dtype` with --engine=sim): the run would ignore it."""
    engine = FLAGS.engine
    for flag, fields in FIELD_FLAGS.items():
        parts = {part for part, _ in fields}
        if not FLAGS[flag].present or ENGINE_PARTS[engine] in parts:
            continue
        others = [name for name, part in ENGINE_PARTS.items() if part in parts]
        if others:  # an engine's field only, and not this engine's
            given = f"no{flag}" if FLAGS[flag].value is False else flag  # as typed: --noleap
            raise app.UsageError(
                f"--{given} is a setting of the {others[0]} engine only; --engine={engine} "
                f"does not read it: drop it, or run --engine={others[0]}")


# Only the prefix workloads read these: another workload keeps them at their defaults, so
# its config (and a sweep's fingerprint of it) does not vary with the engine.
PREFIX_FIELDS = ("num_prefixes", "prefix_len", "prefix_zipf", "suffix_len", "num_turns",
                 "think_time_ms")


def _field_values(part: type) -> dict[str, Any]:
    """The fields of `part` that have flags, from the flags (an unset engine-dependent one
    from the engine's column of `COMMAND_DEFAULTS`)."""
    column = COMMAND_DEFAULTS[FLAGS.engine]
    values = {}
    for flag, fields in FIELD_FLAGS.items():
        for owner, name in fields:
            if owner is part:
                value = FLAGS[flag].value
                values[name] = column[name] if value is None and name in column else value
    return values


def spec_from_flags() -> RunSpec:
    """The RunSpec the flags describe (unset flags take the engine's defaults)."""
    _take_renamed_flags()
    _check_router_flags()
    _check_engine_flags()
    workload = _field_values(WorkloadSpec)
    if FLAGS.workload not in ("shared_prefix", "conversation"):
        workload = {k: v for k, v in workload.items() if k not in PREFIX_FIELDS}
    if FLAGS.workload in ("trace", "program_trace"):
        workload["num_requests"] = FLAGS.num_requests  # unset: the whole trace
    if FLAGS.workload == "trace":
        # Unset: the trace's own output lengths, and an error where it has none.
        workload["output_len"] = FLAGS.output_len
    if FLAGS.workload in ("trace", "program_trace"):
        # --rate given: the trace rescaled to it (as sweep --rates does); unset, its own times.
        workload["trace_at_rate"] = bool(FLAGS["rate"].present)
    limits = _field_values(LimitsSpec)
    try:  # before a ladder is listed out up to the budget
        check_step_tokens(limits["max_num_tokens"])
    except ValueError as e:
        raise _spec_usage_error(e) from e
    token_buckets, bucket_ladder = _buckets(limits["max_num_tokens"])
    try:
        engine: JaxEngineSpec | SimEngineSpec
        if FLAGS.engine == "jax":
            # A process setting, not part of the spec: a cached program is the same program.
            from orca_jax.model import compile_cache
            compile_cache.enable(FLAGS.compile_cache)
            engine = JaxEngineSpec(**_field_values(JaxEngineSpec))
            if engine.clock == "profiled":  # a process setting too, as the compile cache
                from orca_jax.sim import profile_store
                profile_store.enable(FLAGS.profile_store)
        else:
            engine = SimEngineSpec(**_field_values(SimEngineSpec))
        return RunSpec(workload=WorkloadSpec(**workload), engine=engine,
                       limits=LimitsSpec(**limits, token_buckets=token_buckets,
                                         bucket_ladder=bucket_ladder),
                       cluster=ClusterSpec(**_field_values(ClusterSpec)),
                       **_field_values(RunSpec))
    except ValueError as e:
        raise _spec_usage_error(e) from e


def _spec_usage_error(error: ValueError) -> app.UsageError:
    """The spec's complaint led by the flag it came from: `--rate: workload.rate must be ...`."""
    match = re.match(r"(?:workload|engine|limits|cluster|run)\.(\w+)", str(error))
    flag_of = {**FLAG_OF_FIELD, "token_buckets": "buckets"}
    flag = flag_of.get(match.group(1), match.group(1)) if match else None
    return app.UsageError(f"--{flag}: {error}" if flag and flag in FLAGS else str(error))


def join_processes() -> Optional[str]:
    """Joins --num_processes processes (jax.distributed) before any jax use.

    Returns:
      The output folder of this process: --out_dir on process 0 (and on a single
      process), OUT_DIR.processK on process K.

    Raises:
      app.UsageError: naming the flag and value that cannot make a process group.
    """
    if FLAGS.num_processes == 1:
        return FLAGS.out_dir
    if FLAGS.engine != "jax":
        raise app.UsageError(f"--num_processes={FLAGS.num_processes} runs the jax engine over "
                             f"several processes; --engine={FLAGS.engine} runs in one")
    from orca_jax.model import distributed

    try:
        group = distributed.ProcessGroup(coordinator=FLAGS.coordinator,
                                         num_processes=FLAGS.num_processes,
                                         process_id=FLAGS.process_id)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    distributed.initialize(group)
    if FLAGS.process_id == 0 or FLAGS.out_dir is None:
        return FLAGS.out_dir
    return f"{FLAGS.out_dir.rstrip('/')}.process{FLAGS.process_id}"


def results_folder(command: str) -> tuple[str, bool]:
    """`(--out_dir, fresh)`: the folder given, or, when --out_dir is not given, a fresh one
    for `command` (`latest_link.fresh_out_dir`), set as --out_dir; `fresh` says which (pass
    it to `link_latest` once the results are written)."""
    if FLAGS["out_dir"].present or FLAGS.out_dir != DEFAULT_OUT_DIR:
        return FLAGS.out_dir, False
    FLAGS.out_dir = str(fresh_out_dir(command))
    return FLAGS.out_dir, True


def link_latest(out_dir: str, fresh: bool) -> None:
    """Points runs/latest at a fresh results folder that the command wrote (nothing for a
    folder given by --out_dir, or one never written: a refused command)."""
    if not fresh or not os.path.isdir(out_dir):
        return
    note = point_latest(out_dir)
    if note:
        print(note, file=sys.stderr)
