"""Driving experiments: compare and sweep check first, labels, no silent knobs,
--describe_policy, --help, progress and whole traces."""

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from cli_runner import REPO
from cli_runner import read_jsonl as _jsonl
from cli_runner import run_module as _run

import policies  # noqa: F401  (registers the built-ins)
from experiments.policy_flags import resolve_policies
from orca_jax.core.api import plugins
from orca_jax.core.api.policy import PolicyLoadError, make_policy, resolve_policy_class
from orca_jax.core.loop.config import SchedulerConfig
from orca_jax.core.plans.limits import StepLimits
from orca_jax.runner.build import check_policy_limits
from orca_jax.runner.progress import Progress

EXAMPLE = "examples/least_attained_service.py:LeastAttainedService"  # registered as `las`
SIM = ["--engine=sim", "--num_requests=20", "--rate=100", "--step_time_ms=5"]


# ----------------------------------------------------------------------- labels
def test_labels_name_variants_and_take_their_own_options():
    entries = resolve_policies(["small=vllm", "big=vllm", "orca"],
                               "small.max_num_seqs=8,orca.kv_reservation=pow2")
    assert [(e.label, e.spec, dict(e.options)) for e in entries] == [
        ("small", "vllm", {"max_num_seqs": "8"}), ("big", "vllm", {}),
        ("orca", "orca", {"kv_reservation": "pow2"})]


def test_a_plugin_by_path_is_labelled_by_its_name_and_takes_it_or_its_class_as_prefix():
    (entry,) = resolve_policies([EXAMPLE], "las.max_running=4")
    assert (entry.label, dict(entry.options)) == ("las", {"max_running": "4"})
    (entry,) = resolve_policies([EXAMPLE], "LeastAttainedService.max_running=5")
    assert dict(entry.options) == {"max_running": "5"}


@pytest.mark.parametrize("items, options, words", [
    (["vllm", "vllm"], "", "label 'vllm' is given twice"),
    (["a=vllm", "a=orca"], "", "label 'a' is given twice"),
    (["small=vllm", "big=vllm"], "vllm.max_num_seqs=8", "label one of ['small', 'big']"),
    (["orca", "nope"], "", "unknown policy 'nope'"),
    (["a/b=orca"], "", "label 'a/b'"),
    (["x="], "", "gives label 'x' no policy"),
])
def test_bad_policy_lists_are_refused_naming_the_culprit(items, options, words):
    with pytest.raises(PolicyLoadError, match=words.replace("[", r"\[").replace("]", r"\]")):
        resolve_policies(items, options)


def test_compare_runs_one_policy_at_two_settings_under_its_labels(tmp_path):
    out = tmp_path / "cmp"
    result = _run("experiments.compare", "--policies=small=vllm,big=vllm,las=" + EXAMPLE,
                  "--policy_opts=small.max_num_seqs=2,las.max_running=3", *SIM,
                  f"--out_dir={out}")
    rows = json.loads((out / "comparison.json").read_text())
    assert [row["policy"] for row in rows] == ["small", "big", "las"]
    for label, cap in (("small", 2), ("big", 256), ("las", None)):
        assert json.loads((out / label / "summary.json").read_text())["policy"] == label
        config = json.loads((out / label / "config.json").read_text())["policy"]
        assert config["label"] == label
        if cap is not None:
            assert config["name"] == "vllm" and config["max_num_seqs"] == cap
    assert json.loads((out / "las" / "config.json").read_text())["policy"]["max_running"] == 3
    assert max(s["num_seqs"] for s in _jsonl(out / "small" / "steps.jsonl")) == 2
    assert max(s["num_seqs"] for s in _jsonl(out / "big" / "steps.jsonl")) > 2
    # The terminal table shows the labels, and fits 120 columns.
    printed = result.stdout.splitlines()
    assert {line.split()[0] for line in printed if line.split()} >= {"small", "big", "las"}
    assert max(len(line) for line in printed if not line.startswith(("figure", "results",
                                                                       "every", "workload"))
               ) <= 120


# ------------------------------------------------------------ check before run
@pytest.mark.parametrize("command, args, words", [
    ("experiments.compare", ["--policies=orca,nope"], "unknown policy 'nope'"),
    ("experiments.compare", ["--policies=orca,vllm", "--policy_opts=vllm.alpah=5"],
     "policy 'vllm' has no option 'alpah'"),
    ("experiments.compare", ["--policies=orca,vllm", "--policy_opts=vllm.max_num_seqs=256"],
     "max_num_seqs=256 exceeds the run's --max_num_seqs=64"),
    ("experiments.sweep", ["--policies=orca,vllm", "--policy_opts=vllm.alpah=5", "--rates=50"],
     "policy 'vllm' has no option 'alpah'"),
    ("experiments.sweep", ["--policies=orca,vllm,vllm", "--rates=50"], "given twice"),
])
def test_compare_and_sweep_fail_on_the_last_policy_before_running_anything(
        tmp_path, command, args, words):
    out = tmp_path / "out"
    result = _run(command, *SIM, *args, f"--out_dir={out}", check=False)
    assert result.returncode != 0
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()  # nothing ran, nothing was written


# --------------------------------------------------------------- silent knobs
def test_a_knob_above_the_scheduler_limit_of_its_name_is_refused_naming_both():
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=64, max_num_tokens=512))
    with pytest.raises(PolicyLoadError, match=r"max_num_seqs=256 exceeds the run's "
                                              r"--max_num_seqs=64"):
        check_policy_limits(make_policy("vllm", {"max_num_seqs": "256"}),
                            {"max_num_seqs": "256"}, config)
    # An old knob name is checked under its new one.
    with pytest.warns(DeprecationWarning, match="max_num_batched_tokens"):
        old_name = make_policy("vllm", {"max_num_batched_tokens": "1024"})
    with pytest.raises(PolicyLoadError, match=r"max_num_tokens=1024 exceeds the run's "
                                              r"--max_num_tokens=512"):
        check_policy_limits(old_name, {"max_num_batched_tokens": "1024"}, config)
    # Defaults above the cap mean "up to the scheduler's", and a knob at the cap is fine.
    check_policy_limits(make_policy("vllm"), {}, config)
    check_policy_limits(make_policy("vllm", {"max_num_seqs": "64"}), {"max_num_seqs": "64"},
                        config)


@pytest.mark.parametrize("args, words", [
    (["--router=least_work"], "--router=least_work routes between replicas, but "
                              "--num_replicas=1"),
    (["--router_opts=cache_threshold=0.5"], "--num_replicas=1"),
    (["--router=no_such_router"], "--router=no_such_router"),
    (["--num_replicas=2", "--router=no_such_router"], "unknown router 'no_such_router'"),
])
def test_router_flags_that_would_do_nothing_or_cannot_load_are_errors(tmp_path, args, words):
    result = _run("experiments.run", *SIM, *args, f"--out_dir={tmp_path / 'run'}", check=False)
    assert result.returncode != 0
    assert words in result.stderr
    assert not (tmp_path / "run").exists()


def test_config_records_the_routers_resolved_knobs(tmp_path):
    out = tmp_path / "run"
    _run("experiments.run", *SIM, "--num_replicas=2", "--router=cache_aware",
         "--router_opts=cache_threshold=0.5", f"--out_dir={out}")
    router = json.loads((out / "config.json").read_text())["router"]
    assert router["name"] == "cache_aware" and router["spec"] == "cache_aware"
    assert router["cache_threshold"] == 0.5
    assert router["balance_abs_threshold"] == 64  # a default, resolved


# ------------------------------------------------------------ describe_policy
def test_describe_lists_each_knob_with_type_default_and_doc():
    text = plugins.describe(resolve_policy_class("vllm"), "policy")
    assert text.startswith("policy 'vllm' (policies.vllm.VLLM): vLLM v1's")
    lines = text.splitlines()
    at = lines.index("  max_num_seqs: int = 256")
    assert lines[at + 1].strip().startswith("most running requests")
    assert "  max_num_seqs: Optional[int] = None" in plugins.describe(
        resolve_policy_class("orca"), "policy")


def test_describe_policy_command_prints_builtins_plugins_and_routers():
    assert "max_running: int = 32" in _run("experiments.run",
                                           f"--describe_policy={EXAMPLE}").stdout
    router = _run("experiments.run", "--describe_policy=cache_aware").stdout
    assert router.startswith("router 'cache_aware'")
    assert "cache_threshold: float = 0.3" in router
    missing = _run("experiments.run", "--describe_policy=nope", check=False)
    assert missing.returncode != 0 and "unknown policy 'nope'" in missing.stderr


# ----------------------------------------------------------------------- help
HELP = {
    "experiments.run": ["--policy", "--describe_policy", "--engine", "--num_requests", "--rate",
                        "--policy_opts", "--router"],
    "experiments.compare": ["--policies", "--repeats", "--engine", "--policy_opts", "--rate"],
    "experiments.sweep": ["--policies", "--rates", "--seeds", "--metric", "--engine"],
    "experiments.reproduce.orca": ["--out_dir", "--figure", "--num_requests", "--rates"],
    "experiments.reproduce.vllm_memory": ["--latency_bound_s", "--[no]buddy", "--rates"],
    "experiments.reproduce.sarathi": ["--workload", "--lengths_file", "--rates"],
    "experiments.reproduce.prefix_caching": ["--trace", "--trace_requests", "--rates"],
}


def test_help_of_each_entry_point_lists_its_own_flags():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    running = {module: subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=REPO,
                                        env=env, stdout=subprocess.PIPE, text=True)
               for module in HELP}
    listed = {}
    for module, flags in HELP.items():
        out, _ = running[module].communicate(timeout=120)
        assert running[module].returncode == 0, module  # (absl's own --help exits 1)
        listed[module] = {line.split(":")[0].strip() for line in out.splitlines()
                          if line.strip().startswith("--")}
        assert set(flags) <= listed[module], (module, set(flags) - listed[module])
    # A sweep's --rates and --seeds replace --rate and --seed.
    assert not {"--rate", "--seed"} & listed["experiments.sweep"]


# ------------------------------------------------------------------- progress
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_on_a_terminal_and_logs_lines_elsewhere(monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = Progress("run x", 10, "requests", delay_s=0.0)
    bar.update(5, "7 steps")
    bar.close()
    assert "5/10" in terminal.getvalue() and "\r" in terminal.getvalue()

    log_file = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log_file)
    caplog.set_level(logging.INFO)
    # absl's own logger too: a command run earlier in this process (train_ranker sets
    # WARNING while orbax writes) may have left it above INFO.
    caplog.set_level(logging.INFO, logger="absl")
    bar = Progress("run x", 10, "requests", delay_s=0.0, interval_s=3600.0)
    for count in range(1, 11):
        bar.update(count, f"{count} steps")
    bar.close("10 steps")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run x")]
    # One line at the start, none within the interval, one at the end.
    assert len(lines) == 2
    assert lines[0].startswith("run x: 1/10 requests") and lines[0].endswith("1 steps")
    assert lines[1].startswith("run x: 10/10 requests") and lines[1].endswith("10 steps")
    assert log_file.getvalue() == ""  # no tqdm frame


# -------------------------------------------------------------- whole traces
AZURE_CODE = next((p for p in (REPO.parent / "shared" / "traces" / "azure_code_2023.csv",
                               REPO.parents[1] / "shared" / "traces" / "azure_code_2023.csv")
                   if p.exists()), None)


@pytest.mark.skipif(AZURE_CODE is None, reason="the Azure code trace is not in ../shared/traces")
def test_a_trace_runs_whole_unless_num_requests_says_otherwise(tmp_path):
    out = tmp_path / "trace"
    stderr_file = tmp_path / "stderr.txt"
    with open(stderr_file, "w") as stderr:
        result = subprocess.run(
            [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
             "--workload=trace", f"--trace={AZURE_CODE}", f"--out_dir={out}"],
            cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
            stderr=stderr, text=True, timeout=600)
    assert result.returncode == 0, stderr_file.read_text()[-2000:]
    assert f"workload: 8819 requests from trace {AZURE_CODE}\n" in result.stdout
    assert json.loads((out / "summary.json").read_text())["num_requests"] == 8819
    assert "\r" not in stderr_file.read_text()  # log lines in a file, never tqdm frames
    cut = _run("experiments.run", "--engine=sim", "--workload=trace", f"--trace={AZURE_CODE}",
               "--num_requests=50", f"--out_dir={tmp_path / 'cut'}")
    assert "workload: 50 requests from trace" in cut.stdout
