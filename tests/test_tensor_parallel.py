"""Tensor parallelism: the Megatron layout, its errors, and tp=2 runs on two forced CPU
devices and over two processes (jax.distributed, gloo on the CPU), each against one tp=1 run.

The test process has one CPU device (JAX is started by then), so runs over two
devices go through the command line in a subprocess started with
`--xla_force_host_platform_device_count=2`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from orca_jax.model import llama as model_lib
from orca_jax.model import sharding, weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config

REPO = Path(__file__).resolve().parents[1]
TINY = get_model_config("tiny")


def _specs_by_name(config, tp):
    _, abstract = model_lib.abstract_model(config)
    specs = sharding.param_specs(abstract, tp)
    return {jax.tree_util.keystr(path): spec for path, spec in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))}


def test_param_specs_follow_the_megatron_layout():
    specs = _specs_by_name(TINY, 2)
    layer = "['layers'][1]"
    for column in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # [in, out]
        assert specs[f"{layer}['{column}']['kernel'].value"] == P(None, "tp"), column
    for row in ("o_proj", "down_proj"):
        assert specs[f"{layer}['{row}']['kernel'].value"] == P("tp", None), row
    assert specs["['embed_tokens']['embedding'].value"] == P()
    assert specs[f"{layer}['input_layernorm']['weight'].value"] == P()
    assert specs["['norm']['weight'].value"] == P()


def test_lm_head_splits_its_vocabulary_only_when_it_divides():
    untied = TINY.__class__(**{**TINY.__dict__, "tie_embeddings": False, "vocab_size": 510})
    assert _specs_by_name(untied, 2)["['lm_head']['kernel'].value"] == P(None, "tp")
    assert _specs_by_name(untied, 4)["['lm_head']['kernel'].value"] == P()


def test_make_mesh_names_what_is_missing():
    # The command line's one-line error for it (exit 2): test_cli_errors' tp_beyond_the_devices.
    with pytest.raises(ValueError, match="tp=4 needs 4 devices, JAX sees 1 .*"
                                         "xla_force_host_platform_device_count=4"):
        sharding.make_mesh(4, TINY)
    # Enough (repeated) devices, but 3 does not divide tiny's 4 query heads.
    with pytest.raises(ValueError, match="tp=3 must divide model 'tiny''s num_q_heads=4"):
        sharding.make_mesh(3, TINY, devices=jax.devices() * 3)
    with pytest.raises(ValueError, match="tp=0"):
        sharding.make_mesh(0, TINY)
    mesh = sharding.make_mesh(1, TINY)
    assert mesh.axis_names == ("tp",) and mesh.size == 1


def test_engine_rejects_a_mesh_without_the_tp_axis():
    params = weights.init_params(TINY, seed=0)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="mesh axes .*'data'.* must be \\('tp',\\)"):
        JaxEngine(TINY, params, num_cache_pages=8, page_size=16, pages_per_seq=2, mesh=mesh)


RUN_FLAGS = ["--engine=jax", "--model=tiny", "--policy=orca", "--num_requests=12", "--rate=50",
             "--prompt_len=uniform:4:40", "--output_len=uniform:1:24", "--max_num_seqs=4",
             "--max_num_tokens=64", "--buckets=16,64"]


def _command(out_dir, *flags):
    return [sys.executable, "-m", "experiments.run", *RUN_FLAGS, f"--out_dir={out_dir}", *flags]


def _run(out_dir, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
               "--xla_force_host_platform_device_count=2")
    return subprocess.run(_command(out_dir, *flags), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _outputs(out_dir):
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {row["id"]: row["output_tokens"] for row in rows}, summary


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    """The one-device run (`--tp=1`) both kinds of split run are checked against: its
    tokens and summary. One command-line run for the module's tests, which only read it."""
    out_dir = tmp_path_factory.mktemp("tp1")
    result = _run(out_dir, "--tp=1")
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, summary = _outputs(out_dir)
    assert sum(map(len, tokens.values())) > 100
    assert summary["tp"] == 1
    return tokens, summary


# The split Pallas run compiles its one 64-token bucket only: most of its time is
# compiling the interpret-mode kernel, once per bucket, and each step of either bucket
# runs the same decode and prefill passes (the kernel's tilings are
# test_ragged_paged_attention's); greedy tokens do not depend on the bucket a step ran in.
SPLIT_RUNS = {"tp2": (["--tp=2"], 2),
              "tp2_pallas": (["--tp=2", "--attention=pallas", "--buckets=64"], 1)}


@pytest.mark.slow
def test_tp2_generates_the_same_tokens_with_half_the_cache_per_device(tmp_path, tp1_run):
    runs = {"tp1": tp1_run}
    for name, (flags, _) in SPLIT_RUNS.items():
        result = _run(tmp_path / name, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = _outputs(tmp_path / name)
    tokens, summary = runs["tp1"]
    assert sum(map(len, tokens.values())) > 100
    for name, (_, num_buckets) in SPLIT_RUNS.items():
        split_tokens, split = runs[name]
        assert split_tokens == tokens, name  # greedy, fp32: identical tokens
        assert split["tp"] == 2
        assert split["kv_cache_bytes_per_device"] * 2 == summary["kv_cache_bytes_per_device"]
        assert split["num_compiles"] == num_buckets  # its buckets, none after warm-up
    # A split step is a different program from the one-device step.
    fingerprints = {name: {k: v for k, v in run[1].items()
                           if k.startswith("compiled_fingerprints.")} for name, run in runs.items()}
    assert fingerprints["tp1"] and fingerprints["tp2"].keys() == fingerprints["tp1"].keys()
    assert fingerprints["tp2"] != fingerprints["tp1"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_tp2_give_the_one_process_tokens(tmp_path, tp1_run):
    """The jax engine over two processes (jax.distributed, gloo on the CPU) with the tp
    mesh spanning them, against the same run in one process without tensor parallelism."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One CPU device per process (the mesh must span both); the session's other flags kept.
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if "host_platform_device_count" not in flag)
    group = ["--tp=2", "--num_processes=2", f"--coordinator=localhost:{_free_port()}"]
    procs = [subprocess.Popen(_command(tmp_path / "tp2", *group, f"--process_id={rank}"),
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    try:
        results = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr[-3000:]

    tokens, summary = tp1_run
    split_tokens, split = _outputs(tmp_path / "tp2")
    assert split_tokens == tokens  # greedy, fp32: the split run computes the same tokens
    follower_tokens, follower = _outputs(tmp_path / "tp2.process1")  # process 1's own record
    assert follower_tokens == tokens
    assert split["tp"] == 2 and summary["tp"] == 1
    assert split["kv_cache_bytes_per_device"] * 2 == summary["kv_cache_bytes_per_device"]
    # Exactly the two buckets, on every process: nothing compiled per step or per transfer.
    assert split["num_compiles"] == follower["num_compiles"] == 2
    assert sorted(k for k in split if k.startswith("compiled_fingerprints.")) == [
        "compiled_fingerprints.16", "compiled_fingerprints.64"]
    # One virtual clock (process 0's step times): the followers' timings are the leader's.
    assert split["num_steps"] == follower["num_steps"]
    assert split["ttft_p99_s"] == follower["ttft_p99_s"]


def test_split_pallas_attention_lowers_for_cuda_with_each_device_s_heads():
    # An abstract 2-device mesh: lowering needs no devices. Each shard's Triton programs
    # cover its own 4 of llama3-8b's 8 KV heads (grid_x).
    import functools
    import re

    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from pallas_kernels.ragged_paged_attention import RaggedAttentionConfig, ragged_paged_attention

    mesh = AbstractMesh(axis_sizes=(2,), axis_names=("tp",))
    attend = sharding.shard_attention(functools.partial(
        ragged_paged_attention, config=RaggedAttentionConfig(block_q=16, block_kv=64)), mesh)
    tokens, slots, pages = 256, 32, (1025, 16, 8, 128)
    args = (jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct(pages, jnp.bfloat16), jax.ShapeDtypeStruct(pages, jnp.bfloat16),
            jax.ShapeDtypeStruct((slots,), jnp.int32),
            jax.ShapeDtypeStruct((slots, 64), jnp.int32),
            jax.ShapeDtypeStruct((slots + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    text = jax.jit(functools.partial(attend, sm_scale=128 ** -0.5)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    # Two passes (decode, prefill), each over this shard's 4 KV heads.
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert [int(x) for x in re.findall(r"grid_x = (\d+) : i32", text)] == [4, 4]
