"""sweep --variants / --variants_file (and compare --variants_file): every policy swept under
every setup on one workload; points say their variant; a resume reuses them."""

import json

import pytest
from cli_runner import read_jsonl, run_module, run_sweep

from orca_jax.results.plots import plot_sweep
from orca_jax.results.sweep_store import (
    PointKey,
    SweepConfigError,
    SweepPointsError,
    SweepStore,
    aggregate,
)

# 2 policies x 2 router variants x 2 rates x 1 seed = 8 points of 16 requests on 2 tiny replicas.
ARGS = ["--engine=sim", "--model=tiny", "--policies=vllm,orca", "--num_replicas=2",
        "--rates=4,32", "--seeds=0", "--num_requests=16", "--prompt_len=uniform:8:256",
        "--output_len=uniform:1:24"]
ROUTERS = "--variants=rr:router=round_robin,lo:router=least_outstanding"
GRID = sorted((policy, variant, rate) for policy in ("vllm", "orca") for variant in ("rr", "lo")
              for rate in (4.0, 32.0))


def _keys(out):
    return sorted((p["policy"], p.get("variant"), p["rate"])
                  for p in read_jsonl(out / "points.jsonl"))


def _point_dir(out, variant, policy, rate):
    return out / "points" / variant / policy / f"rate_{rate:g}_seed_0"


def _workload(path):
    """The columns of requests.jsonl that the workload, not the run, decides."""
    return [(row["id"], row["arrival_s"], row["prompt_len"], row["output_len"])
            for row in read_jsonl(path)]


def test_two_router_variants_sweep_every_policy_on_one_workload(tmp_path):
    out = tmp_path / "sweep"
    result = run_sweep(out, *ARGS, ROUTERS, "--point_runs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _keys(out) == GRID
    configs = {(v, p, r): json.loads((_point_dir(out, v, p, r) / "config.json").read_text())
               for _, v, r in GRID for p in ("vllm", "orca")}
    # Each variant ran its own router ...
    assert {key: c["router"]["name"] for key, c in configs.items()} == {
        key: {"rr": "round_robin", "lo": "least_outstanding"}[key[0]] for key in configs}
    # ... on the very same requests at each rate,
    for rate in (4.0, 32.0):
        workloads = [_workload(_point_dir(out, v, p, rate) / "requests.jsonl")
                     for v in ("rr", "lo") for p in ("vllm", "orca")]
        assert len(workloads[0]) == 16 and all(w == workloads[0] for w in workloads)
        # ... with the ladder of one pilot per rate: the very same fit (its wall time too).
        fits = [configs[v, p, rate]["bucket_fit"] for v in ("rr", "lo") for p in ("vllm", "orca")]
        assert all(fit == fits[0] for fit in fits)
    stored = json.loads((out / "sweep.json").read_text())
    assert stored["variants"] == {"rr": {}, "lo": {"router": "least_outstanding"}}
    table = (out / "sweep.txt").read_text()
    assert [line.split()[0] for line in table.splitlines()[2:]] == [
        "vllm@rr", "vllm@rr", "orca@rr", "orca@rr", "vllm@lo", "vllm@lo", "orca@lo", "orca@lo"]


def test_a_killed_variant_sweep_resumes_only_its_missing_points(tmp_path):
    out = tmp_path / "sweep"
    killed = run_sweep(out, *ARGS, ROUTERS, exit_after=3)
    assert killed.returncode == 3, killed.stderr[-3000:]
    before = (out / "points.jsonl").read_bytes().splitlines(keepends=True)
    assert len(before) == 3
    rerun = run_sweep(out, *ARGS, ROUTERS)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = (out / "points.jsonl").read_bytes().splitlines(keepends=True)
    assert after[:3] == before and len(after) == 8
    assert _keys(out) == GRID  # each point once: the resumed ones were not run again
    assert "3 resumed" in rerun.stderr
    # A label that now sets something else is another sweep: refused, nothing appended.
    changed = run_sweep(out, *ARGS, "--variants=rr:router=round_robin,lo:router=cache_aware")
    assert changed.returncode == 2
    assert ("variants.lo.router: stored 'least_outstanding', now 'cache_aware'"
            in changed.stderr)
    assert (out / "points.jsonl").read_bytes().splitlines(keepends=True) == after


def test_a_variants_file_holds_values_with_commas(tmp_path):
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps({
        "rr": {"router": "round_robin"},
        "ca": {"router": "cache_aware",
               "router_opts": "cache_threshold=0.5,balance_abs_threshold=8"}}))
    out = tmp_path / "sweep"
    result = run_sweep(out, *ARGS, "--policies=vllm", "--rates=8", f"--variants_file={spec}",
                       "--point_runs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _keys(out) == [("vllm", "ca", 8.0), ("vllm", "rr", 8.0)]
    assert json.loads((out / "sweep.json").read_text())["variants"]["ca"] == {
        "router": "cache_aware", "router_opts": "cache_threshold=0.5,balance_abs_threshold=8"}
    config = json.loads((_point_dir(out, "ca", "vllm", 8.0) / "config.json").read_text())
    assert config["router"]["name"] == "cache_aware"


def test_compare_takes_a_variants_file(tmp_path):
    spec = tmp_path / "variants.json"
    spec.write_text('{"co": {"num_replicas": 2}, "dis": {"prefill_replicas": 1, '
                    '"decode_replicas": 1}}')
    out = tmp_path / "compare"
    run_module("experiments.compare", "--engine=sim", "--num_requests=12", "--policies=vllm",
               f"--variants_file={spec}", f"--out_dir={out}")
    rows = json.loads((out / "comparison.json").read_text())
    assert [(row["policy"], row["variant"]) for row in rows] == [("vllm@co", "co"),
                                                                ("vllm@dis", "dis")]
    dis = json.loads((out / "dis" / "vllm" / "config.json").read_text())
    assert "pools" in dis


@pytest.mark.parametrize("text, extra, says", [
    ('{"rr": {"router": "round_robin"},\n "x": {"rate": 3}}', (),
     "variants.json: x: rate changes the workload"),
    ('{"x": {"rooter": "a"}}', (), "variants.json: x: rooter is not a run flag"),
    ('{"x": {"num_replicas": 0}}', (), "variants.json: x: num_replicas=0:"),
    ('{"x": {"router": "nope"}}', (), "variants.json: x: unknown router 'nope'"),
    ('{"x": {"router": {"name": "rr"}}}', (),
     'variants.json: x: router: {"name": "rr"} is not a flag\'s value'),
    ('{"x y": {}}', (), "variants.json: label 'x y' must be letters"),
    ('{"x": {}, "x": {}}', (), "variants.json: 'x' is given twice"),
    ('{"x": {"router": "round_robin",}}', (), "variants.json: line 1, column 32: not JSON"),
    ('["rr"]', (), "variants.json: must be a JSON object of labels"),
    ('{"x": {}}', ("--variants=y:",), "--variants and --variants_file: give the variants one way"),
])
def test_a_bad_variants_file_is_one_line_exit_2_and_nothing_written(tmp_path, text, extra, says):
    spec = tmp_path / "variants.json"
    spec.write_text(text)
    out = tmp_path / "sweep"
    result = run_sweep(out, *ARGS, f"--variants_file={spec}", *extra)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert not out.exists()


def test_a_missing_variants_file_is_one_line_exit_2(tmp_path):
    result = run_module("experiments.compare", "--engine=sim", "--policies=vllm",
                        f"--variants_file={tmp_path / 'none.json'}",
                        f"--out_dir={tmp_path / 'out'}", check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "none.json: cannot read it" in lines[0], result.stderr


def test_a_malformed_points_line_is_one_line_naming_file_and_line_exit_2(tmp_path):
    out = tmp_path / "sweep"
    assert run_sweep(out, *ARGS, "--policies=vllm").returncode == 0
    lines = (out / "points.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    (out / "points.jsonl").write_bytes(b'{"policy": "vllm"}\n' + lines[1])
    result = run_sweep(out, *ARGS, "--policies=vllm")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{out / 'points.jsonl'}:1: not a sweep point (KeyError: 'rate')" in lines[0]


def test_the_store_keys_points_by_variant_and_writes_the_old_line_without_one(tmp_path):
    store = SweepStore(tmp_path, {"num_requests": 10}, {"vllm": {"spec": "vllm", "options": {}}},
                       variants={"rr": {}, "ca": {"router": "cache_aware"}})
    plain = store.append(PointKey("vllm", 4.0, 0), {"ttft_p99_s": 0.1, "throughput_req_s": 3.0})
    # A point of no variant is the line a sweep wrote before variants existed.
    assert set(plain) == {"policy", "rate", "seed", "session", "finished_at", "summary"}
    store.append(PointKey("vllm", 4.0, 0, "rr"), {"ttft_p99_s": 0.2, "throughput_req_s": 3.0})
    store.append(PointKey("vllm", 4.0, 0, "ca"), {"ttft_p99_s": 0.3, "throughput_req_s": 3.0})
    assert store.finished_keys() == {PointKey("vllm", 4.0, 0), PointKey("vllm", 4.0, 0, "rr"),
                                     PointKey("vllm", 4.0, 0, "ca")}
    keys = [PointKey("vllm", 4.0, 0, "rr"), PointKey("vllm", 4.0, 0, "ca")]
    curves = aggregate(store.load(), keys, "throughput_req_s", "ttft_p99_s")
    assert [(c.label, float(c.y_mean[0])) for c in curves] == [("vllm@rr", 0.2), ("vllm@ca", 0.3)]
    figure = plot_sweep(curves, str(tmp_path / "sweep.png"), x_field="throughput_req_s",
                        y_field="ttft_p99_s")
    if figure is not None:  # matplotlib installed
        legend = figure.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == ["vllm@rr", "vllm@ca"]
    # A new variant may join; a stored label with other settings may not.
    SweepStore(tmp_path, {"num_requests": 10}, {}, variants={"lo": {"router": "x"}})
    assert set(json.loads((tmp_path / "sweep.json").read_text())["variants"]) == {"rr", "ca", "lo"}
    with pytest.raises(SweepConfigError, match=r"variants\.ca\.router: stored 'cache_aware'"):
        SweepStore(tmp_path, {"num_requests": 10}, {}, variants={"ca": {"router": "prefix_hash"}})
    # A sweep without variants writes no `variants`.
    SweepStore(tmp_path / "plain", {"num_requests": 10}, {})
    assert "variants" not in json.loads((tmp_path / "plain" / "sweep.json").read_text())
    with open(store.points_path, "r+b") as f:
        f.write(b"x")  # the first line, broken
    with pytest.raises(SweepPointsError, match=r"points\.jsonl:1: not a sweep point"):
        store.load()


def test_the_figure_caption_says_what_each_variant_sets():
    from experiments.variant_flags import Setup, caption_note
    from orca_jax.runner.spec import ClusterSpec, RunSpec

    spec = RunSpec(cluster=ClusterSpec(num_replicas=2))
    setups = [Setup("rr", spec),
              Setup("ca", RunSpec(cluster=ClusterSpec(num_replicas=2, router="cache_aware"))),
              Setup("dis", RunSpec(cluster=ClusterSpec(num_prefill_replicas=1,
                                                       num_decode_replicas=1)))]
    assert caption_note(spec, setups) == (
        "; variants rr: the command's own setup; ca: router=cache_aware; dis: "
        "num_replicas=1, num_prefill_replicas=1, num_decode_replicas=1")
    assert caption_note(spec, [Setup(None, spec)]) == ""


def test_run_sweep_refuses_a_variant_with_another_workload(tmp_path):
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    from orca_jax.runner.sweep import PolicyRun, SweepError
    from orca_jax.runner.sweep import run_sweep as run_grid

    spec = RunSpec(workload=WorkloadSpec(num_requests=8))
    other = RunSpec(workload=WorkloadSpec(num_requests=9))
    with pytest.raises(SweepError, match="variant x: its workload differs from the sweep's"):
        run_grid(spec, [PolicyRun("vllm", "vllm")], [4.0], [0], str(tmp_path / "s"),
                 variants={"ok": spec, "x": other})
    assert not (tmp_path / "s" / "sweep.json").exists()
