"""Loading policies: by name, `module:Class` and `file.py:Class`; options; errors; no jax.

Also holds the package boundaries of DESIGN.md: `policies/` never imports jax
(checked in a fresh interpreter and by reading every file), `pallas_kernels/`
never imports `orca_jax`.
"""

import ast
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import policies
from orca_jax.core.api.policy import (
    Policy,
    PolicyLoadError,
    make_policy,
    parse_options,
    resolve_policy_class,
)
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from policies.orca import Orca
from policies.static import Static

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "plugins" / "example_policy.py"
PLUGIN_SPEC = f"{PLUGIN}:ShortestPromptFirst"


def test_builtins_load_by_registered_name():
    registered = policies.registered_policies()
    assert registered["orca"] is Orca and registered["static"] is Static
    orca = make_policy("orca")
    assert type(orca) is Orca and orca.name == "orca" and orca.kv_reservation == "max"
    static = make_policy("static")
    assert type(static) is Static and static.defer_release
    assert make_policy("orca") is not orca  # a fresh instance per run: policies keep state


def test_load_by_module_path():
    assert resolve_policy_class("policies.orca:Orca") is Orca
    policy = make_policy("policies.static:Static", {"max_num_seqs": "3"})
    assert type(policy) is Static and policy.max_num_seqs == 3 and policy.name == "static"


def test_load_by_file_path_absolute_and_relative(monkeypatch):
    cls = resolve_policy_class(PLUGIN_SPEC)
    assert cls.__name__ == "ShortestPromptFirst" and issubclass(cls, Policy)
    assert cls.name == "example_spf"  # the name given to @register in the file
    assert policies.registered_policies()["example_spf"] is cls
    monkeypatch.chdir(ROOT)
    again = resolve_policy_class("tests/plugins/example_policy.py:ShortestPromptFirst")
    assert again.__qualname__ == cls.__qualname__ and again.name == "example_spf"


def test_unregistered_plugin_class_gets_its_lowercase_name(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(textwrap.dedent("""
        from orca_jax import StepPlan
        from orca_jax.core.api.policy import Policy

        class RunNothing(Policy):
            def schedule(self, view):
                return StepPlan()
    """))
    policy = make_policy(f"{path}:RunNothing")
    assert policy.name == "runnothing" and policy.kv_reservation == "none"


def test_a_file_without_its_class_says_to_name_one_and_lists_the_file_s_policies(tmp_path):
    path = tmp_path / "two_policies.py"
    path.write_text(textwrap.dedent("""
        from orca_jax import StepPlan
        from orca_jax.core.api.policy import Policy
        from policies.orca import Orca  # imported, not defined here: not listed

        class RunNothing(Policy):
            def schedule(self, view):
                return StepPlan()

        class AlsoNothing(RunNothing):
            pass
    """))
    with pytest.raises(PolicyLoadError) as error:
        resolve_policy_class(str(path))
    message = str(error.value)
    assert "unknown policy" not in message
    assert f"give {path}:ClassName" in message
    assert message.endswith(f"its Policy subclasses: {path}:AlsoNothing, {path}:RunNothing")
    with pytest.raises(PolicyLoadError, match=r"give missing\.py:ClassName .*does not exist"):
        resolve_policy_class("missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(PolicyLoadError, match="it defines no Policy subclass$"):
        resolve_policy_class(str(empty))


def test_policy_opts_convert_to_field_types():
    options = parse_options("max_batch_size=3, prefill_chunk=64,max_wait_s=0.25,"
                            "longest_first=yes,kv_reservation=exact")
    assert options == {"max_batch_size": "3", "prefill_chunk": "64", "max_wait_s": "0.25",
                       "longest_first": "yes", "kv_reservation": "exact"}
    policy = make_policy(PLUGIN_SPEC, options)
    assert policy.max_batch_size == 3 and isinstance(policy.max_batch_size, int)
    assert policy.prefill_chunk == 64 and isinstance(policy.prefill_chunk, int)
    assert policy.max_wait_s == 0.25 and policy.longest_first is True
    assert policy.kv_reservation == "exact"
    defaults = make_policy(PLUGIN_SPEC)
    assert defaults.max_batch_size is None and math.isinf(defaults.max_wait_s)
    assert defaults.longest_first is False and defaults.prefill_chunk == 512
    assert make_policy(PLUGIN_SPEC, {"max_batch_size": "None"}).max_batch_size is None
    assert make_policy(PLUGIN_SPEC, {"max_wait_s": "1e-3"}).max_wait_s == 1e-3
    assert make_policy(PLUGIN_SPEC, {"max_wait_s": "inf"}).max_wait_s == math.inf
    for text, value in [("true", True), ("1", True), ("on", True), ("False", False),
                        ("0", False), ("no", False), ("off", False)]:
        assert make_policy(PLUGIN_SPEC, {"longest_first": text}).longest_first is value
    assert make_policy("orca", parse_options("max_num_seqs=7")).max_num_seqs == 7
    assert parse_options("") == {} and parse_options(" , ") == {}
    assert parse_options("a=x=y") == {"a": "x=y"}


@pytest.mark.parametrize("options, words", [
    ({"max_batch_size": "three"}, ["example_spf", "max_batch_size", "int", "three"]),
    ({"prefill_chunk": "1.5"}, ["example_spf", "prefill_chunk", "int", "1.5"]),
    ({"max_wait_s": "soon"}, ["example_spf", "max_wait_s", "float", "soon"]),
    ({"longest_first": "maybe"}, ["example_spf", "longest_first", "maybe"]),
    ({"kv_reservation": "lots"}, ["example_spf", "kv_reservation", "lots"]),
    ({"batch": "4"}, ["example_spf", "batch", "max_batch_size", "prefill_chunk"]),
])
def test_bad_options_name_policy_and_option(options, words):
    with pytest.raises(PolicyLoadError) as raised:
        make_policy(PLUGIN_SPEC, options)
    for word in words:
        assert word in str(raised.value)


def test_scheduler_refuses_an_unknown_kv_reservation_of_a_policy_built_directly():
    # make_policy checks its options; a policy built in code reaches the scheduler unchecked,
    # and an unknown mode must not silently mean "max".
    from orca_jax import Request, Scheduler, SchedulerConfig
    from orca_jax.core.api.policy import KV_RESERVATIONS
    from orca_jax.sim.cost_model import CostModelConfig
    from orca_jax.sim.engine import SimEngine

    policy = Orca()
    policy.kv_reservation = "bogus"
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2)]
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    with pytest.raises(ValueError) as raised:
        Scheduler(requests, policy, engine, SchedulerConfig())
    assert str(raised.value) == (f"policy 'orca': kv_reservation 'bogus' is not one of "
                                 f"{KV_RESERVATIONS}")


@pytest.mark.parametrize("policy, old, new", [
    ("vllm", "max_num_batched_tokens", "max_num_tokens"),
    ("sarathi", "token_budget", "max_num_tokens"),
    ("orca", "max_batch_size", "max_num_seqs"),
    ("static", "max_batch_size", "max_num_seqs"),
])
def test_an_old_option_name_sets_the_renamed_knob_with_a_warning(policy, old, new):
    with pytest.warns(DeprecationWarning, match=f"option '{old}' is deprecated; use '{new}'"):
        built = make_policy(policy, {old: "7"})
    assert getattr(built, new) == 7
    with pytest.warns(DeprecationWarning):
        assert getattr(make_policy(policy, {old: "7", new: "7"}), new) == 7  # same value: fine
    with pytest.raises(PolicyLoadError, match=f"options {old}=7 and {new}=9 disagree"):
        make_policy(policy, {old: "7", new: "9"})


def test_the_view_s_old_limit_names_read_the_new_values_and_warn_once(monkeypatch):
    from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
    from orca_jax.core.plans import view as view_module
    from orca_jax.sim.cost_model import CostModelConfig
    from orca_jax.sim.engine import SimEngine

    monkeypatch.setattr(view_module, "_warned", set())  # other tests may have warned already
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=3, max_num_tokens=32,
                                               max_model_len=64),
                             kv=KVConfig(num_kv_pages=40, page_size=4))
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2)]
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    view = Scheduler(requests, Orca(), engine, config).view
    for old, new, value in [("token_budget", "max_num_tokens", 32),
                            ("max_batch_size", "max_num_seqs", 3),
                            ("num_total_pages", "num_kv_pages", 40)]:
        assert getattr(view, new) == value
        with pytest.warns(DeprecationWarning, match=f"SchedulerView.{old} is deprecated; "
                                                    f"use SchedulerView.{new}"):
            assert getattr(view, old) == value
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a plugin reads it every step: once is enough
            assert getattr(view, old) == value


def test_fields_set_by_the_policy_itself_are_not_options():
    with pytest.raises(PolicyLoadError, match="'static' has no option 'defer_release'"):
        make_policy("static", {"defer_release": "false"})


@pytest.mark.parametrize("text", ["max_batch_size", "=3", "a=1,b"])
def test_malformed_policy_opts(text):
    with pytest.raises(PolicyLoadError, match="is not key=value"):
        parse_options(text)


def test_unknown_name_lists_registered_policies():
    with pytest.raises(PolicyLoadError) as raised:
        make_policy("orka")
    message = str(raised.value)
    assert "'orka'" in message
    for name in policies.registered_policies():
        assert name in message
    assert "module:Class" in message and "file.py:Class" in message


@pytest.mark.parametrize("spec, words", [
    ("tests/plugins/no_such_file.py:Anything", ["no_such_file.py", "does not exist"]),
    (f"{PLUGIN}:NoSuchClass", ["example_policy.py", "NoSuchClass"]),
    ("policies.orca:NoSuchClass", ["policies.orca", "NoSuchClass"]),
    ("policies.no_such_module:Orca", ["policies.no_such_module", "cannot import"]),
    ("orca_jax.core.plans.plan:StepPlan", ["StepPlan", "not an orca_jax Policy subclass"]),
    ("policies.orca:fit_to_budget", ["'fit_to_budget'", "not an orca_jax Policy subclass"]),
])
def test_load_errors_name_what_is_wrong(spec, words):
    with pytest.raises(PolicyLoadError) as raised:
        make_policy(spec)
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_plugin_that_fails_to_import_is_reported(tmp_path):
    path = tmp_path / "broken_policy.py"
    path.write_text("import numpy\nraise RuntimeError('half-written plugin')\n")
    with pytest.raises(PolicyLoadError) as raised:
        make_policy(f"{path}:Broken")
    message = str(raised.value)
    assert "broken_policy.py" in message and "RuntimeError" in message
    assert "half-written plugin" in message
    assert "orca_jax_plugin_broken_policy" not in sys.modules  # nothing half-loaded


def test_plugin_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=12,
                                         prompt_len="uniform:4:64", output_len="uniform:1:8"),
                   engine=SimEngineSpec(step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=1, max_num_tokens=64, num_kv_pages=64,
                                     page_size=8, max_model_len=128), seed=4)
    summary, result = run_policy(spec, "tests/plugins/example_policy.py:ShortestPromptFirst",
                                 out_dir=str(tmp_path / "spf"), progress=False)
    assert summary["policy"] == "example_spf"
    assert summary["num_finished"] == 12 and summary["num_rejected"] == 0
    assert (tmp_path / "spf" / "summary.json").exists()
    # One at a time (batch cap 1), all arrived at once: served shortest prompt first,
    # ties in arrival order.
    served = np.argsort(result.first_scheduled_s, kind="stable")
    expected = np.lexsort((np.arange(12), result.prompt_len))
    np.testing.assert_array_equal(served, expected)
    # The longest-first knob reverses it.
    _, longest = run_policy(spec, "tests/plugins/example_policy.py:ShortestPromptFirst",
                            {"longest_first": "true"}, progress=False)
    served = np.argsort(longest.first_scheduled_s, kind="stable")
    np.testing.assert_array_equal(served, np.lexsort((np.arange(12), -result.prompt_len)))


def test_policies_never_import_jax_in_a_fresh_interpreter():
    code = ("import sys, policies; "
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
            "assert not loaded, loaded")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


JAX_FAMILY = {"jax", "jaxlib", "flax", "optax", "orbax"}


def test_no_policy_file_imports_jax():
    files = sorted((ROOT / "policies").glob("*.py"))
    assert {"orca.py", "static.py"} <= {f.name for f in files}
    for path in files + [PLUGIN]:
        bad = [m for m in _imported_modules(path) if _top(m) in JAX_FAMILY]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_pallas_kernels_never_import_orca_jax():
    files = sorted((ROOT / "pallas_kernels").glob("*.py"))
    assert files
    for path in files:
        bad = [m for m in _imported_modules(path) if _top(m) in ("orca_jax", "policies")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_import_scanner_sees_every_import_form(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import os, jax.numpy as jnp\nfrom flax import nnx\n"
                    "def f():\n    import optax\n")
    assert {_top(m) for m in _imported_modules(path)} == {"os", "jax", "flax", "optax"}


def test_register_refuses_a_non_policy_and_a_taken_name():
    from orca_jax.cluster.routing import Router, register_router
    from orca_jax.core.api.policy import register

    with pytest.raises(TypeError, match=r"@register\('x'\) expects a Policy subclass"):
        register("x")(object)
    with pytest.raises(TypeError, match=r"@register_router\('x'\) expects a Router subclass"):
        register_router("x")(object)

    class Other(Policy):
        def schedule(self, view):
            raise NotImplementedError

    make_policy("orca")  # the built-ins are registered
    with pytest.raises(ValueError, match="policy name 'orca' is already registered by "
                                         "policies.orca.Orca"):
        register("orca")(Other)

    class Elsewhere(Router):
        def route(self, view, request):
            return 0

    with pytest.raises(ValueError, match="router name 'round_robin' is already registered"):
        register_router("round_robin")(Elsewhere)


def test_a_plugin_that_never_leaps_gets_one_hint_line_and_its_opt_in_leaps_exactly(tmp_path):
    from cli_runner import run_module

    from orca_jax.runner.leap_hint import OPT_IN, leap_hint
    las = "examples/least_attained_service.py:LeastAttainedService"
    args = ("experiments.run", "--engine=sim", "--num_requests=60", "--rate=20")
    plain = run_module(*args, f"--policy={las}", f"--out_dir={tmp_path / 'plain'}")
    lines = plain.stdout.splitlines()
    hints = [i for i, line in enumerate(lines) if line.startswith("hint: ")]
    assert len(hints) == 1 and las in lines[hints[0]]
    # Wrapped to 100 columns, the opt-in on a line of its own to paste.
    hint = lines[hints[0]:lines.index(f"    {OPT_IN}") + 1]
    assert all(len(line) <= 100 for line in hint[:-1]) and len(hint) <= 6
    assert "leaped over 0 of" in plain.stderr
    # The hint's own line, pasted into the plugin: it leaps, with the same results.
    source = (ROOT / "examples" / "least_attained_service.py").read_text().replace(
        '@register("las")\n', "")
    source += f"\n    {OPT_IN}\n"
    plugin = tmp_path / "steady_las.py"
    plugin.write_text(source)
    leaped = run_module(*args, f"--policy={plugin}:LeastAttainedService",
                        f"--out_dir={tmp_path / 'leap'}")
    assert "hint: " not in leaped.stdout and "leaped over 0 of" not in leaped.stderr
    assert "leaped over " in leaped.stderr
    stepwise = run_module(*args, f"--policy={plugin}:LeastAttainedService", "--noleap",
                          f"--out_dir={tmp_path / 'noleap'}")
    assert "hint: " not in stepwise.stdout  # no leaping to miss
    assert ((tmp_path / "leap" / "requests.jsonl").read_text()
            == (tmp_path / "noleap" / "requests.jsonl").read_text()
            == (tmp_path / "plain" / "requests.jsonl").read_text())
    # A built-in that promises nothing does so on purpose: no hint; a promising one none.
    assert leap_hint(RunSpec(), "mlfq") is None and leap_hint(RunSpec(), "orca") is None
    assert leap_hint(RunSpec(), las) is not None
    assert leap_hint(RunSpec(limits=LimitsSpec(count_host_time=True)), las) is None
    assert f"    {OPT_IN}\n" in (ROOT / "docs" / "writing_a_policy.md").read_text()



def test_knob_docs_come_from_the_attributes_section_as_the_docs_show(tmp_path):
    """docs/writing_a_policy.md's example of a documented knob, described as it says."""
    from orca_jax.core.api import plugins
    doc = (ROOT / "docs" / "writing_a_policy.md").read_text()
    section = doc[doc.index("### Documenting its knobs"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", 20)]
    plugin = tmp_path / "documented.py"
    plugin.write_text("import dataclasses\n\nfrom orca_jax import Policy, StepPlan\n\n\n"
                      + code + "\n    def schedule(self, view):\n"
                      "        return StepPlan([], [])\n")
    described = plugins.describe(resolve_policy_class(f"{plugin}:LeastAttainedService"),
                                 "policy")
    printed = section[section.index("it prints\n\n") + 11:section.index("\n\n(one entry")]
    assert textwrap.dedent(printed) in described
    # Without the section, the knob has no doc (an inline comment is not read).
    bare = tmp_path / "bare.py"
    bare.write_text(plugin.read_text().replace(
        "\n    Attributes:\n      max_running: requests that may hold KV pages at once.\n", ""))
    assert "requests that may hold" not in plugins.describe(
        resolve_policy_class(f"{bare}:LeastAttainedService"), "policy")
