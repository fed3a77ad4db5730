"""Flags from one source: each run flag of a spec field says what its field says.

`experiments.flags` defines the flag of every documented spec field from the
field (default, help, choices); `flag_spec_mismatches` walks the fields again
and names each flag whose default or help differs. The last tests plant a
mismatch (a field's default or doc, a flag's default, a new router) and see the
checker report exactly that, naming the flag and the field.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from experiments import flags as run_flags
from orca_jax.cluster import routing
from orca_jax.runner.spec import (
    COMMAND_DEFAULTS,
    ClusterSpec,
    JaxEngineSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
)


def _field(part: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(part) if f.name == name)


def test_every_flag_of_a_spec_field_has_its_fields_default_and_help():
    assert run_flags.flag_spec_mismatches() == []


def test_the_walk_gives_every_field_of_every_part_a_flag_or_a_reason():
    with_flags = {(part, name) for fields in run_flags.FIELD_FLAGS.values()
                  for part, name in fields}
    for part in run_flags.SPEC_PARTS:
        for field in dataclasses.fields(part):
            assert ((part, field.name) in with_flags) != (
                field.name in run_flags.FLAGLESS_FIELDS), (part.__name__, field.name)
    # The flags named otherwise than their field, and the two-engine settings.
    assert run_flags.FIELD_FLAGS["workload"] == ((WorkloadSpec, "arrival"),)
    assert run_flags.FIELD_FLAGS["prefill_replicas"] == ((ClusterSpec, "num_prefill_replicas"),)
    assert run_flags.FIELD_FLAGS["tp"] == ((JaxEngineSpec, "tp"), (SimEngineSpec, "tp"))
    assert run_flags.FIELD_FLAGS["seed"] == ((RunSpec, "seed"),)


def test_choice_flags_list_their_registries_and_the_clock_says_what_it_is():
    flags = run_flags.FLAGS
    for router in ("round_robin", "least_outstanding", "least_work", "cache_aware",
                   "prefix_hash"):
        assert router in flags["router"].help and router in flags["decode_router"].help
    assert "h200" in flags["hardware"].help and "pcie5" in flags["kv_link"].help
    assert flags["clock"].help.startswith("<profiled|wall>: jax: ")
    assert "median" not in flags["clock"].help
    assert flags["kv_link"].help.startswith("Disaggregated, and migrations: the KV link preset.")
    assert "load_balance" in flags["rebalancer"].help
    assert flags["migration"].help.startswith("<live|stop_and_copy>: ")


def test_engine_dependent_defaults_come_from_the_one_table():
    flags = run_flags.FLAGS
    for name in COMMAND_DEFAULTS["sim"]:
        assert flags[name].default is None
        assert (f"Default: {COMMAND_DEFAULTS['jax'][name]} on jax, "
                f"{COMMAND_DEFAULTS['sim'][name]} on sim.") in flags[name].help
    assert flags["num_requests"].help.endswith("Default: 64 on jax, 1000 on sim.")
    flags.unparse_flags()  # from the defaults, whatever an earlier test parsed
    try:
        flags(["run", "--engine=sim"])
        spec = run_flags.spec_from_flags()
    finally:
        flags.unparse_flags()
    assert spec.workload.num_requests == 1000 and spec.workload.rate == 32.0
    assert spec.limits.max_num_seqs == 64 and spec.engine.model == "llama3-8b"
    # Away from the table, a flag's default is the field's.
    assert spec.workload.cv == _field(WorkloadSpec, "cv").default == flags["cv"].default


# ---------------------------------------------------------------- planted mismatches
def test_a_planted_field_default_is_reported_naming_flag_and_field(monkeypatch):
    monkeypatch.setattr(_field(WorkloadSpec, "cv"), "default", 2.0)
    assert run_flags.flag_spec_mismatches() == [
        "--cv: default 1.0, but WorkloadSpec.cv says 2.0"]


def test_a_planted_flag_default_is_reported_naming_flag_and_field(monkeypatch):
    monkeypatch.setattr(run_flags.FLAGS["page_size"], "default", 32)
    assert run_flags.flag_spec_mismatches() == [
        "--page_size: default 32, but LimitsSpec.page_size says 16"]


def test_a_planted_field_doc_is_reported_naming_flag_and_field(monkeypatch):
    field = _field(LimitsSpec, "max_model_len")
    monkeypatch.setattr(field, "metadata", types.MappingProxyType(
        {**field.metadata, "help": "The context limit, in tokens."}))
    assert run_flags.flag_spec_mismatches() == [
        "--max_model_len: help \"Context limit (None: the model's).\", but "
        "LimitsSpec.max_model_len says 'The context limit, in tokens.'"]


def test_a_planted_engine_default_disagreement_is_reported(monkeypatch):
    monkeypatch.setattr(_field(SimEngineSpec, "tp"), "default", 2)
    (line,) = run_flags.flag_spec_mismatches()
    assert line.startswith("--tp: fields ['JaxEngineSpec.tp', 'SimEngineSpec.tp'] disagree on "
                           "their default")


def test_a_router_registered_after_the_flags_is_reported_on_each_router_flag(monkeypatch):
    monkeypatch.setitem(routing._ROUTERS, "planted", routing.Router)
    lines = run_flags.flag_spec_mismatches()
    assert [line.split(":")[0] for line in lines] == [
        "--router", "--prefill_router", "--decode_router"]
    assert all("planted" in line.rpartition("says")[2] for line in lines)


def test_an_undocumented_field_is_named(monkeypatch):
    field = _field(ClusterSpec, "kv_link_max_concurrent")
    monkeypatch.setattr(field, "metadata", types.MappingProxyType({}))
    assert run_flags.flag_spec_mismatches() == [
        "--kv_link_max_concurrent: ClusterSpec.kv_link_max_concurrent has no doc "
        "(runner.spec._knob) for its flag's help: document it, or list it in FLAGLESS_FIELDS"]


def test_a_dropped_flag_is_named(monkeypatch):
    monkeypatch.setattr(run_flags, "FLAGLESS_FIELDS",
                        {k: v for k, v in run_flags.FLAGLESS_FIELDS.items() if k != "kv_layout"})
    assert run_flags.flag_spec_mismatches() == [
        "--kv_layout: not defined, for LimitsSpec.kv_layout (or list it in FLAGLESS_FIELDS)"]


@pytest.mark.parametrize("name", ["rate", "router", "clock"])
def test_each_field_flag_is_checked(monkeypatch, name):
    # Not only the flags the tests above pick: any flag's planted default is caught.
    monkeypatch.setattr(run_flags.FLAGS[name], "default", "planted")
    (line,) = run_flags.flag_spec_mismatches()
    assert line.startswith(f"--{name}: default 'planted', but ")


def test_every_registered_or_preset_name_is_in_its_flags_help():
    import experiments.policy_flags  # noqa: F401  (defines --policies)
    import experiments.run  # noqa: F401  (defines --policy)
    from experiments.list_flags import LISTINGS
    from orca_jax.core.api.policy import registered_policies

    flags = run_flags.FLAGS
    of_listing = {"policies": ("policy", "policies"),
                  "routers": ("router", "prefill_router", "decode_router"),
                  "models": ("model",), "hardware": ("hardware",)}
    assert set(of_listing) == set(LISTINGS)
    registries = {"policies": registered_policies, "routers": routing.registered_routers}
    for listing, flag_names in of_listing.items():
        names = LISTINGS[listing][1]()
        if listing in registries:  # the built-ins (this process may hold test plugins too)
            names = [name for name in names
                     if registries[listing]()[name].__module__.startswith("policies")]
        assert names  # each registry has names to list
        for flag in flag_names:
            missing = [name for name in names if name not in flags[flag].help]
            assert missing == [], (flag, missing)
    for name in ("cache_aware", "prefix_hash"):
        assert name in LISTINGS["routers"][1]()
    for name in ("llama3.1-8b", "llama3-70b", "llama2-70b"):
        assert name in LISTINGS["models"][1]()
    assert "vllm" in LISTINGS["policies"][1]() and "h200" in LISTINGS["hardware"][1]()
    assert "KV tile" in flags["clock"].help
