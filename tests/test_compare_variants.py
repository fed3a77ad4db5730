"""compare --variants: every policy under every setup, on one workload with one pilot."""

import json

import pytest
from cli_runner import read_jsonl, run_module

SIM = ("--engine=sim", "--num_requests=40")
PILOT_LINE = "buckets: fit:16: "  # once per fit, whatever the pilots' count


def _compare(out, *args, check=True):
    return run_module("experiments.compare", *SIM, f"--out_dir={out}", *args, check=check)


def _workload(path):
    """The columns of requests.jsonl that the workload, not the run, decides."""
    return [(row["id"], row["arrival_s"], row["prompt_len"], row["output_len"])
            for row in read_jsonl(path)]


def _config(out, variant, policy="vllm"):
    return json.loads((out / variant / policy / "config.json").read_text())


def test_three_routers_in_one_command_share_the_workload_and_the_pilot(tmp_path):
    out = tmp_path / "routers"
    result = _compare(out, "--policies=vllm", "--num_replicas=2",
                      "--variants=rr:router=round_robin,lo:router=least_outstanding,"
                      "ca:router=cache_aware")
    assert result.stdout.count(PILOT_LINE) == 1
    rows = json.loads((out / "comparison.json").read_text())
    assert [(row["policy"], row["variant"]) for row in rows] == [
        ("vllm@rr", "rr"), ("vllm@lo", "lo"), ("vllm@ca", "ca")]
    assert [row["num_finished"] for row in rows] == [40, 40, 40]
    workloads = [_workload(out / v / "vllm" / "requests.jsonl") for v in ("rr", "lo", "ca")]
    assert len(workloads[0]) == 40 and workloads[0] == workloads[1] == workloads[2]
    configs = {v: _config(out, v) for v in ("rr", "lo", "ca")}
    assert {v: c["router"]["name"]
            for v, c in configs.items()} == {
        "rr": "round_robin", "lo": "least_outstanding", "ca": "cache_aware"}
    # The one fitted ladder: every variant compiles the same steps.
    assert len({tuple(c["bucket_fit"]["token_sizes"]) for c in configs.values()}) == 1
    # The router matters: not every variant gives the same latencies.
    assert len({row["ttft_p99_s"] for row in rows}) > 1


def test_colocated_two_against_disaggregated_one_plus_one(tmp_path):
    out = tmp_path / "codis"
    result = _compare(out, "--policies=vllm,orca",
                      "--variants=co:num_replicas=2,dis:prefill_replicas=1;decode_replicas=1")
    assert result.stdout.count(PILOT_LINE) == 1
    rows = json.loads((out / "comparison.json").read_text())
    assert [row["policy"] for row in rows] == ["vllm@co", "orca@co", "vllm@dis", "orca@dis"]
    # One ladder fitted to both policies' pilots of the command's own setup.
    assert _config(out, "co")["bucket_fit"]["pilot_policies"] == ["vllm", "orca"]
    assert "pools" in _config(out, "dis") and "pools" not in _config(out, "co")
    assert _config(out, "co")["bucket_fit"] == _config(out, "dis", "orca")["bucket_fit"]
    assert (_workload(out / "co" / "vllm" / "requests.jsonl")
            == _workload(out / "dis" / "orca" / "requests.jsonl"))
    by_label = {row["policy"]: row for row in rows}
    assert by_label["vllm@co"]["ttft_p99_s"] != by_label["vllm@dis"]["ttft_p99_s"]


def test_a_variant_that_sets_the_ladder_runs_its_own_sizes(tmp_path):
    out = tmp_path / "ladders"
    result = _compare(out, "--policies=vllm", "--variants=p:bucket_ladder=pow2,base:")
    assert result.stdout.count(PILOT_LINE) == 1
    assert "note: the variants run different bucket sizes" in result.stdout
    assert "bucket_fit" not in _config(out, "p") and "bucket_fit" in _config(out, "base")


@pytest.mark.parametrize("variants, says", [
    ("x:rate=3", "--variants: x: rate changes the workload"),
    ("x:rooter=a", "--variants: x: rooter is not a run flag"),
    ("x:num_replicas=0", "--variants: x: num_replicas=0:"),
    ("ok:num_replicas=2,x:num_replicas=2;router=nope", "--variants: x: unknown router 'nope'"),
    ("x:prefill_replicas=1", "--variants: x: cluster: a disaggregated cluster needs both"),
    ("x=num_replicas=2", "--variants: 'x=num_replicas=2' must be LABEL:key=value"),
])
def test_a_bad_variant_is_one_line_exit_2_and_nothing_written(tmp_path, variants, says):
    out = tmp_path / "bad"
    result = _compare(out, "--policies=vllm", f"--variants={variants}", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert not out.exists()


def test_variants_are_checked_as_resolved_not_against_the_command_s_own_settings(tmp_path):
    # 70B does not fit one A100 (the command's own --tp=1); each variant sets its own tp.
    args = ("--policies=vllm", "--model=llama3-70b", "--num_requests=12")
    out = tmp_path / "tp"
    result = _compare(out, *args, "--variants=t4:tp=4,t8:tp=8")
    assert "vllm@t4" in result.stdout and "vllm@t8" in result.stdout
    assert _config(out, "t4")["run"]["engine"]["tp"] == 4
    assert _config(out, "t8")["run"]["engine"]["tp"] == 8
    # A variant that does not fit is named; nothing is written.
    bad = _compare(tmp_path / "one", *args, "--variants=t4:tp=4,t1:tp=1", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("error: --variants: t1: --model: engine.model=llama3-70b: "
                                 "model llama3-70b") and "does not fit on 1 x" in bad.stderr
    assert not (tmp_path / "one").exists()
    # No variant fixes it: the command's own error, as without variants.
    neither = _compare(tmp_path / "none", *args, "--variants=a:max_num_seqs=4,b:max_num_seqs=8",
                       check=False)
    assert neither.returncode == 2 and neither.stderr.startswith(
        "error: --model: engine.model=llama3-70b") and "--variants" not in neither.stderr
