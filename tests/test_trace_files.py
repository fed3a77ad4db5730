"""Where the reproductions find their traces: $ORCA_JAX_TRACES, else shared/traces beside
the repository (never the working directory), and one line where the trace is missing."""

import json

import pytest

from experiments.reproduce import kv_tiers_mooncake, prefix_caching, sarathi, trace_files
from experiments.reproduce.trace_files import (
    ARXIV_LENGTHS,
    AZURE_CONV,
    MOONCAKE,
    TRACES_ENV,
    trace_path,
    traces_dir,
)
from orca_jax.workloads.traces import TraceError, load_trace, prefix_cache_ceiling
from tests.cli_runner import REPO, run_module

# Mooncake's format: each turn's blocks extend the previous turn's, arrivals far apart.
TURNS = [[0, 1], [0, 1, 2], [0, 1, 2, 3], [5, 6]]


def _mooncake(folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MOONCAKE
    path.write_text("".join(
        json.dumps({"timestamp": 60_000 * k, "input_length": 512 * len(ids),
                    "output_length": 4, "hash_ids": ids}) + "\n"
        for k, ids in enumerate(TURNS)))
    return path


def test_the_variable_names_the_folder_the_trace_is_read_from(tmp_path, monkeypatch):
    path = _mooncake(tmp_path / "traces")
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "traces"))
    monkeypatch.chdir(tmp_path)  # anywhere: the folder is the variable's, not the cwd's
    assert traces_dir() == tmp_path / "traces"
    assert trace_path(MOONCAKE) == str(path)
    requests = load_trace(trace_path(MOONCAKE), vocab_size=1000)
    assert [r.prompt_len for r in requests] == [1024, 1536, 2048, 1024]
    assert prefix_caching.PrefixCachingSetup().trace_file() == str(path)
    # the ceiling of the four prompts: 5 of their 11 blocks were seen before
    assert prefix_cache_ceiling(trace_path(MOONCAKE), page_size=16) == pytest.approx(5 / 11)


def test_without_the_variable_the_folder_is_beside_the_repository_not_the_cwd(
        tmp_path, monkeypatch):
    monkeypatch.delenv(TRACES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert traces_dir() == REPO.parent / "shared" / "traces"
    monkeypatch.setenv(TRACES_ENV, "  ")  # blank is unset
    assert traces_dir() == REPO.parent / "shared" / "traces"


def test_a_named_file_is_used_as_it_is_and_must_be_there(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "empty"))  # not looked in
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "l.csv").write_text("num_prefill_tokens,num_decode_tokens\n30,4\n")
    assert trace_path(MOONCAKE, "my/l.csv") == "my/l.csv"
    assert sarathi.SarathiSetup().for_workload("arxiv", "my/l.csv").prompt_len == (
        "empirical:my/l.csv:num_prefill_tokens")
    with pytest.raises(TraceError, match=r"^--lengths_file=my/none.csv: no such file$"):
        sarathi.SarathiSetup().for_workload("arxiv", "my/none.csv")
    with pytest.raises(TraceError, match=r"^--trace=my: no such file$"):  # a folder
        trace_path(MOONCAKE, "my")


@pytest.mark.parametrize("name,flag,source", [
    (MOONCAKE, "--trace", "github.com/kvcache-ai/Mooncake"),
    (AZURE_CONV, "--trace", "Azure LLM inference trace 2023"),
    (ARXIV_LENGTHS, "--lengths_file", "github.com/microsoft/vidur")])
def test_a_missing_trace_is_one_line_saying_where_to_look_and_get_it(
        tmp_path, monkeypatch, name, flag, source):
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    with pytest.raises(TraceError) as raised:
        trace_path(name, flag=flag)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"trace {name} not found: no {tmp_path / name} "
                              f"(${TRACES_ENV}={tmp_path}); set {TRACES_ENV} ")
    assert f"with {flag};" in message and source in message
    monkeypatch.delenv(TRACES_ENV)
    if not (trace_files.DEFAULT_TRACES_DIR / name).is_file():  # a clone without the folder
        with pytest.raises(TraceError, match=f"\\${TRACES_ENV} unset, so the folder beside"):
            trace_path(name)


def test_sarathi_arxiv_looks_for_the_lengths_file_only_for_arxiv(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert sarathi.SarathiSetup().for_workload("synthetic") == sarathi.SarathiSetup()
    with pytest.raises(TraceError, match=f"no {tmp_path / ARXIV_LENGTHS} .*--lengths_file"):
        sarathi.SarathiSetup().for_workload("arxiv")
    (tmp_path / ARXIV_LENGTHS).write_text("num_prefill_tokens,num_decode_tokens\n30,4\n")
    setup = sarathi.SarathiSetup().for_workload("arxiv")
    assert setup.prompt_len == f"empirical:{tmp_path / ARXIV_LENGTHS}:num_prefill_tokens"


@pytest.mark.parametrize("module", ["kv_tiers_mooncake", "prefix_caching", "distserve"])
def test_a_reproduction_without_its_trace_stops_in_one_line_before_writing(tmp_path, module):
    out = tmp_path / "out"
    result = run_module(f"experiments.reproduce.{module}", f"--out_dir={out}", check=False,
                        env={TRACES_ENV: str(tmp_path)})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trace ")
    assert TRACES_ENV in lines[0] and "get it from" in lines[0]
    assert not out.exists()


def test_kv_tiers_mooncake_writes_its_tables_under_out_dir(tmp_path, monkeypatch, capsys):
    # 40 prompts of 100 tokens at once (one 512-token block each, 4 distinct): the device
    # pool of a tenth of the peak still holds the largest.
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / MOONCAKE).write_text("".join(
        json.dumps({"timestamp": 0, "input_length": 100, "output_length": 4,
                    "hash_ids": [k % 4]}) + "\n" for k in range(40)))
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "traces"))
    out = tmp_path / "out"
    kv_tiers_mooncake.main([f"--out_dir={out}", "--time_scale=1"])
    assert "tables: " in capsys.readouterr().out
    tiers = json.loads((out / "tiers.json").read_text())
    assert tiers["setup"]["trace"] == str(tmp_path / "traces" / MOONCAKE)
    assert tiers["setup"]["working_set_pages"] == 4 * 6  # 4 blocks, 6 full pages each
    assert [row["run"] for row in tiers["rows"]] == [
        "unbounded device", "device only, 1/10 of peak", "device + host (working set)"]
    policies = json.loads((out / "cache_policies.json").read_text())
    assert [row["policy"] for row in policies["rows"]] == ["lru", "lfu", "arc"] * 2
    assert (out / "tiers.txt").read_text().startswith("run")
    assert (out / "cache_policies.txt").is_file()
