"""Every bad input to the entry points: one line naming the culprit, the exit status, nothing
half-written.

One table: each row is a command line (a bad flag, trace, checkpoint, plugin or plan), the
exit status it must end with (2: bad usage; 1: a failed run) and text its one error line
must hold. The rows run as processes of their own, two at a time (the simulator where it
can; the jax engine only where the input is the real model's), once per module, each forked
from one process that imported the entry points' modules once (`forked_cli`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
RAISING = "tests/plugins/raising_policy.py"
SIM = ("--engine=sim", "--num_requests=4")
JAX = ("--engine=jax", "--num_requests=2", "--max_num_tokens=16", "--max_num_seqs=2")


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad command: `python -m MODULE ARGS --out_dir=...`."""

    name: str
    args: tuple[str, ...]
    status: int
    says: str  # a regex the error line must match (it names the culprit)
    module: str = "experiments.run"


def _cases(files: Path) -> list[Case]:
    return [
        Case("rate_zero", (*SIM, "--rate=0"), 2, r"--rate: workload\.rate .*> 0.*got 0\.0"),
        Case("rate_nan", (*SIM, "--rate=nan"), 2, r"--rate: workload\.rate .*got nan"),
        Case("rate_inf", (*SIM, "--rate=inf"), 2, r"--rate: workload\.rate .*got inf"),
        Case("cv_zero", (*SIM, "--workload=gamma", "--cv=0"), 2, r"--cv: workload\.cv .*got 0\.0"),
        Case("kv_memory_zero", (*SIM, "--kv_memory_gb=0"), 2,
             r"--kv_memory_gb: limits\.kv_memory_gb .*got 0\.0"),
        Case("step_time_zero", (*SIM, "--step_time_ms=0"), 2,
             r"--step_time_ms: engine\.step_time_ms .*got 0\.0"),
        Case("buckets_text", (*SIM, "--buckets=abc"), 2, r"--buckets=abc: expected integers"),
        Case("buckets_unsorted", (*SIM, "--buckets=2048,16"), 2,
             r"--buckets: limits\.token_buckets must ascend.*\(2048, 16\)"),
        Case("buckets_short_of_budget", (*SIM, "--buckets=16,32"), 2,
             r"--buckets: limits\.token_buckets .*max_num_tokens \(2048\).*\(16, 32\)"),
        Case("cost_fit_missing", (*SIM, "--cost_fit=no_such_fit.json"), 2,
             r"cost fit no_such_fit\.json: No such file"),
        Case("hardware_unknown", (*SIM, "--hardware=nope"), 2, r"hardware preset 'nope'"),
        Case("model_unknown_sim", (*SIM, "--model=nope"), 2, r"unknown model 'nope'"),
        Case("model_unknown_jax", ("--engine=jax", "--model=nope"), 2, r"unknown model 'nope'"),
        Case("prompt_len_huge", (*SIM, "--prompt_len=fixed:100000000000000000000"), 2,
             r"--prompt_len=fixed:10{20}.*at most 2147483647"),
        # Counts no machine's memory holds: refused before anything is allocated (they were
        # numpy's ArrayMemoryError, a ValueError deep in the run, and a hang).
        Case("num_requests_1e12", (*SIM, "--num_requests=1000000000000"), 2,
             r"--num_requests: workload\.num_requests=1000000000000 is above its cap of "
             r"[\d,]+: requests take at least 512 B each and this machine has [\d.]+ GiB"),
        Case("num_kv_pages_1e11", (*SIM, "--num_kv_pages=100000000000"), 2,
             r"--num_kv_pages: limits\.num_kv_pages=100000000000 gives 100,000,000,000 KV "
             r"pages, above the cap of [\d,]+ pages: "),
        Case("max_model_len_1e11", (*SIM, "--max_model_len=100000000000"), 2,
             r"--max_model_len: limits\.max_model_len=100000000000 is above its cap of [\d,]+: "),
        Case("kv_memory_1e12", (*SIM, "--kv_memory_gb=1e12"), 2,
             r"--kv_memory_gb: limits\.kv_memory_gb=1e\+12 gives 476,837,158,203,125 KV pages "
             r"\(of llama3-8b, page_size 16\), above the cap of [\d,]+ pages: "),
        Case("page_size_1e9", (*SIM, "--page_size=1000000000"), 2,
             r"--page_size: limits\.page_size=1000000000: model llama3-8b on 1 x a100-80gb: KV "
             r"memory of .* holds no page of 1000000000 tokens"),
        Case("max_num_tokens_1e10", (*SIM, "--max_num_tokens=10000000000"), 2,
             r"--max_num_tokens: limits\.max_num_tokens=10000000000 is above its cap of "
             r"[\d,]+: "),
        Case("max_num_tokens_1e10_rule_ladder",
             (*SIM, "--max_num_tokens=10000000000", "--bucket_ladder=step:8"), 2,
             r"--max_num_tokens: limits\.max_num_tokens=10000000000 is above its cap of "
             r"[\d,]+: "),
        # KV tiers beyond any machine, and tier settings with no tier (issue 51).
        Case("kv_host_gb_1e15", (*SIM, "--kv_host_gb=1e15"), 2,
             r"^error: --kv_host_gb=1e\+15 gives [\d,]+ KV pages, above the cap of "
             r"2,147,483,646 pages a tier holds"),
        Case("kv_host_pages_1e15", (*SIM, "--kv_host_pages=1000000000000000"), 2,
             r"^error: --kv_host_pages=1000000000000000 gives 1,000,000,000,000,000 KV pages"),
        Case("kv_disk_pages_1e15",
             (*SIM, "--kv_host_pages=8", "--kv_disk_pages=1000000000000000"), 2,
             r"^error: --kv_disk_pages=1000000000000000 gives 1,000,000,000,000,000 KV pages"),
        Case("kv_cache_policy_without_tier", (*SIM, "--kv_cache_policy=arc"), 2,
             r"--kv_cache_policy: limits\.kv_cache_policy 'arc' is a setting of the slower KV "
             r"tiers, and the run has none"),
        Case("kv_pin_without_programs", (*SIM, "--kv_pin_s=5"), 2,
             r"--kv_pin_s: limits\.kv_pin_s 5 pins an agent program's KV between its calls; "
             r"workload 'poisson' has no programs"),
        Case("noleap_on_jax", (*JAX, "--noleap"), 2,
             r"--noleap is a setting of the sim engine only; --engine=jax does not read it"),
        Case("dtype_on_sim", (*SIM, "--dtype=bfloat16"), 2,
             r"--dtype is a setting of the jax engine only; --engine=sim does not read it"),
        Case("flag_unknown", (*SIM, "--no_such_flag=1"), 2, r"no_such_flag"),
        Case("policy_unknown", (*SIM, "--policy=nope"), 2, r"unknown policy 'nope'"),
        Case("policy_option_unknown", (*SIM, "--policy_opts=alpah=5"), 2,
             r"policy 'orca' has no option 'alpah'"),
        Case("compare_opts_without_policy", (*SIM, "--policy_opts=max_num_seqs=4"), 2,
             r"--policy_opts: 'max_num_seqs=4' must be \w+\.key=value",
             module="experiments.compare"),
        Case("sweep_opts_without_policy", (*SIM, "--rates=2", "--policy_opts=max_num_seqs=4"),
             2, r"--policy_opts: 'max_num_seqs=4' must be \w+\.key=value",
             module="experiments.sweep"),
        Case("sweep_goodput_without_slo", (*SIM, "--rates=2", "--metric=goodput"), 2,
             r"--metric=goodput counts requests within the SLOs; set --ttft_slo_s",
             module="experiments.sweep"),
        Case("trace_not_utf8", (*SIM, "--workload=trace", f"--trace={files}/latin1.csv"), 2,
             r"latin1\.csv:3: byte 0xe9 at column 13 is not UTF-8"),
        Case("trace_extra_cell", (*SIM, "--workload=trace", f"--trace={files}/extra.csv"), 2,
             r"extra\.csv:3: 4 cells under a header of 3 columns .*cell 4 \('99'\) has no "
             r"column"),
        Case("trace_prompt_1e20", (*SIM, "--workload=trace", f"--trace={files}/huge.jsonl"), 2,
             r"huge\.jsonl:2: field 'prompt_len': .*at most 2147483647, got 1e\+20"),
        Case("trace_without_output_lengths",
             (*SIM, "--workload=trace", f"--trace={files}/prompts.csv"), 2,
             r"prompts\.csv: field 'output_len': in no record .*give the output lengths with "
             r"--output_len"),
        Case("trace_blocks_of_16_read_as_512",
             (*SIM, "--workload=trace", f"--trace={files}/blocks16.jsonl"), 2,
             r"blocks16\.jsonl:1: field 'input_length': .*\(2 blocks of 512 in 'hash_ids'; "
             r".*--trace_block_size\), got 32"),
        Case("checkpoint_truncated", (*JAX, f"--checkpoint={files}/truncated"), 2,
             r"truncated/model\.safetensors: not a readable safetensors file"),
        Case("checkpoint_random_bytes", (*JAX, f"--checkpoint={files}/random"), 2,
             r"random/model\.safetensors: not a readable safetensors file"),
        Case("checkpoint_misshaped_tensor", (*JAX, f"--checkpoint={files}/misshaped"), 2,
             r"misshaped/model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight "
             r"has shape \(3, 3\)"),
        Case("checkpoint_bad_config", (*JAX, f"--checkpoint={files}/bad_config"), 2,
             r"bad_config/config\.json: unreadable model config \(JSONDecodeError"),
        Case("checkpoint_empty_folder", (*JAX, f"--checkpoint={files}/empty"), 2,
             r"empty: empty folder; expected an orbax checkpoint or a LLaMA-format folder"),
        Case("profile_table_other_dtype", (*JAX, f"--profile_table={files}/bf16_table.json"), 2,
             r"profile table .*bf16_table\.json was measured for another setup: .*"
             r"dtype='bfloat16' \(this run: 'float32'\)"),
        Case("profile_table_wall_clock", (*JAX, "--clock=wall", "--profile_table=t.json"), 2,
             r"engine\.profile_table \('t\.json'\) is the profiled clock's table"),
        Case("draft_other_vocabulary", (*JAX, "--model=small", "--clock=wall", "--drafter=model",
                                        "--draft_model=tiny-draft"), 2,
             r"--draft_model: engine\.draft_model 'tiny-draft' has a vocabulary of 512 "
             r"tokens, the target 'small' 2048: a draft must share the target's vocabulary "
             r"\(presets that share it: small-draft\)"),
        Case("sim_draft_other_vocabulary", (*SIM, "--model=llama3-70b", "--tp=4",
                                            "--draft_model=tinyllama-1.1b"), 2,
             r"--draft_model: engine\.draft_model 'tinyllama-1\.1b' has a vocabulary of 32000 "
             r"tokens, the target 'llama3-70b' 128256: a draft must share the target's "
             r"vocabulary \(presets that share it: llama3\.2-1b, llama3-8b, llama3\.1-8b\)"),
        Case("drafter_model_without_draft", (*JAX, "--clock=wall", "--drafter=model"), 2,
             r"--drafter: engine\.drafter model needs engine\.draft_model"),
        # Checked where the engine is built: this process has one CPU device.
        Case("tp_beyond_the_devices", (*JAX, "--tp=2"), 2,
             r"tp=2 needs 2 devices, JAX sees 1 \(cpu\); on a CPU, start with "
             r"XLA_FLAGS=--xla_force_host_platform_device_count=2"),
        Case("spec_k_without_drafter", (*JAX, "--spec_k=2"), 2,
             r"--spec_k: limits\.spec_k 2: the jax engine speculates only with a drafter"),
        Case("spec_k_negative", (*SIM, "--spec_k=-1"), 2,
             r"--spec_k: limits\.spec_k must be >= 0, got -1"),
        Case("plugin_import_fails", (*SIM, f"--policy={files}/broken_plugin.py:Broken"), 2,
             r"broken_plugin\.py:Broken': importing .*broken_plugin\.py' failed: NameError: "
             r"name 'undefined_name'"),
        Case("plan_breaks_a_rule", (*SIM, f"--policy={RAISING}:UnknownRequest"), 1,
             r"policy 'unknownrequest' broke rule 'unknown_request': .* 999"),
    ]


def _write_inputs(files: Path) -> None:
    from safetensors.numpy import save_file
    from test_weights import HF_CONFIG, random_hf_tensors

    (files / "latin1.csv").write_bytes(b"arrival_s,prompt_len,output_len\n0,10,5\n"
                                       b"0.1,10,5,caf\xe9\n")
    (files / "extra.csv").write_text("arrival_s,prompt_len,output_len\n0,5,3\n0.1,6,5,99\n")
    (files / "prompts.csv").write_text("prompt_len\n5\n7\n")
    (files / "blocks16.jsonl").write_text('{"input_length": 32, "output_length": 2, '
                                          '"hash_ids": [1, 2]}\n')
    (files / "huge.jsonl").write_text('{"arrival_s": 0, "prompt_len": 10, "output_len": 2}\n'
                                      '{"arrival_s": 1, "prompt_len": 1e20, "output_len": 2}\n')
    for name in ("truncated", "random", "misshaped", "bad_config", "empty"):
        (files / name).mkdir()
    for name in ("truncated", "random", "misshaped"):
        (files / name / "config.json").write_text(json.dumps(HF_CONFIG))
    tensors = random_hf_tensors()
    save_file(tensors, str(files / "truncated" / "model.safetensors"))
    whole = (files / "truncated" / "model.safetensors").read_bytes()
    (files / "truncated" / "model.safetensors").write_bytes(whole[:len(whole) // 2])
    (files / "random" / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(files / "misshaped" / "model.safetensors"))
    (files / "bad_config" / "config.json").write_text("{not json")
    entry = dict(base_s=1e-3, per_seq_s=0.0, per_tile_s=0.0, q_tile=4, kv_tile=128)
    (files / "bf16_table.json").write_text(json.dumps({
        "format": "orca_jax.cost_fit/1", "buckets": {"16": entry},
        "metadata": {"kind": "profiled_clock", "model": "tiny", "dtype": "bfloat16"}}))
    (files / "broken_plugin.py").write_text("from orca_jax import Policy\n\n"
                                            "class Broken(Policy):\n    x = undefined_name\n")


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")


def _run(module: str, args: tuple[str, ...], out_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args, f"--out_dir={out_dir}"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[Case, Path, subprocess.CompletedProcess]]:
    """Runs every case once, each its own process, two at a time (the machine has 2 cores),
    forked from one that imported the entry points' modules (`forked_cli`)."""
    from forked_cli import run_forked

    files = tmp_path_factory.mktemp("inputs")
    _write_inputs(files)
    cases = _cases(files)
    outs = tmp_path_factory.mktemp("outs")
    results = run_forked([(case.module, (*case.args, f"--out_dir={outs / case.name}"))
                          for case in cases], tmp_path_factory.mktemp("streams"), _env())
    return {case.name: (case, outs / case.name, result)
            for case, result in zip(cases, results)}


def _error_lines(stderr: str) -> list[str]:
    """stderr's lines but the noise a library may print before the run (jax's log setup)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("WARNING: All log messages before",
                                                       "E0000", "W0000", "I0000"))]


def _assert_nothing_half_written(out_dir: Path) -> None:
    """No results that look complete, and no temporary file, in the run's folder."""
    if not out_dir.exists():
        return
    names = {p.name for p in out_dir.rglob("*")}
    assert "summary.json" not in names and "comparison.txt" not in names, names
    assert not any(name.endswith(".tmp") for name in names), names


CASE_NAMES = [case.name for case in _cases(Path("/unused"))]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_line_naming_the_culprit(outcomes, name):
    case, out_dir, result = outcomes[name]
    lines = _error_lines(result.stderr)
    assert result.returncode == case.status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert re.search(case.says, lines[0]), lines[0]
    _assert_nothing_half_written(out_dir)


def test_an_error_in_a_plugin_shows_its_own_frames_ending_at_its_line(tmp_path):
    result = _run("experiments.run", (*SIM, f"--policy={RAISING}:RaisesAtStep"),
                  tmp_path / "out")
    assert result.returncode == 1
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines[0].startswith("Traceback")
    assert lines[-1] == "RuntimeError: planted failure at step 5"
    files = re.findall(r'File "([^"]+)", line (\d+)', result.stderr)
    assert files and all(path.endswith("raising_policy.py") for path, _ in files), files
    plugin_source = (REPO / RAISING).read_text().splitlines()
    assert "RAISES HERE" in plugin_source[int(files[-1][1]) - 1]
    # No frame of the framework's or absl's (every frame above is the plugin's, whatever
    # the clone's folder is called), and no second traceback chained to this one.
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "During handling" not in result.stderr, result.stderr
    _assert_nothing_half_written(tmp_path / "out")


def test_an_error_raised_inside_the_framework_keeps_its_whole_traceback():
    from experiments.cli_errors import clean_errors, plugin_traceback
    from orca_jax.workloads.synthetic import arrival_times

    # This test's frame stands where a plugin's would: it called into the framework, which
    # raised. A ValueError is no usage error either: it goes on, traceback and all.
    with pytest.raises(ValueError, match="rate must be a finite number") as info:
        with clean_errors():
            arrival_times("poisson", 3, np.random.default_rng(0), rate=0.0)
    assert plugin_traceback(info.value) is None


def test_sigint_prints_one_line_and_exits_130(tmp_path):
    # The child ignores SIGINT while it imports, then takes Python's own handler (a shell's
    # background job, CI's say, would hand it SIGINT ignored) and says it is ready.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN);"
             " import experiments.flags, policies;"
             " signal.signal(signal.SIGINT, signal.default_int_handler);"
             " print('ready', flush=True); sys.argv = ['run', *sys.argv[1:]];"
             " runpy.run_module('experiments.run', run_name='__main__', alter_sys=True)")
    process = subprocess.Popen(
        [sys.executable, "-c", start, "--engine=sim", "--num_requests=200000",
         f"--out_dir={tmp_path / 'out'}"], cwd=REPO, env={**_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    # Into the run, however long the machine takes to get there: the workload is built
    # (the pilot run and the run itself take far longer than the signal does).
    assert process.stdout.readline().startswith("workload: 200000 requests")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert _error_lines(stderr.split("\r")[-1]) == [
        "interrupted (SIGINT): stopped before the run finished"], stderr
    _assert_nothing_half_written(tmp_path / "out")


def test_a_prompt_longer_than_any_context_is_rejected_without_building_its_ids(tmp_path):
    # 2e9 prompt ids would take 7.45 GiB each; the run rejects the requests up front.
    result = _run("experiments.run", (*JAX, "--num_requests=3", "--clock=wall",
                                      "--prompt_len=fixed:2000000000", "--output_len=fixed:4"),
                  tmp_path / "out")
    assert result.returncode == 0, result.stderr
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    assert peak_gib < 3.0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_rejected"] == 3 and summary["num_finished"] == 0


def test_draft_presets_of_the_8b_and_70b_families_share_their_vocabularies():
    from orca_jax.specs.model_config import PRESETS, draft_presets
    # Published sizes: Llama-3.2-1B 1.24B weights (tied), TinyLlama-1.1B 1.10B.
    assert round(PRESETS["llama3.2-1b"].num_params / 1e9, 2) == 1.24
    assert round(PRESETS["tinyllama-1.1b"].num_params / 1e9, 2) == 1.10
    assert draft_presets("llama3-8b") == ["llama3.2-1b"]
    assert draft_presets("llama3-70b") == ["llama3.2-1b", "llama3-8b", "llama3.1-8b"]
    assert draft_presets("llama2-70b") == ["tinyllama-1.1b", "llama2-7b", "codellama-34b"]
    assert draft_presets("llama3.2-1b") == [] and draft_presets("mistral-7b") == []
