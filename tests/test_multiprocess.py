"""The jax engine over two processes (jax.distributed, gloo on the CPU) with the tp mesh
spanning them, against the same run in one process without tensor parallelism."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import distributed

REPO = Path(__file__).resolve().parents[1]
RUN_FLAGS = ["--engine=jax", "--model=tiny", "--policy=orca", "--num_requests=12", "--rate=50",
             "--prompt_len=uniform:4:40", "--output_len=uniform:1:24", "--max_num_seqs=4",
             "--max_num_tokens=64", "--buckets=16,64"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _command(out_dir, *flags):
    return [sys.executable, "-m", "experiments.run", *RUN_FLAGS, f"--out_dir={out_dir}", *flags]


def _outputs(out_dir):
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    return ({row["id"]: row["output_tokens"] for row in rows},
            json.loads((out_dir / "summary.json").read_text()))


@pytest.mark.slow
def test_two_processes_with_tp2_give_the_one_process_tokens(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One CPU device per process (the mesh must span both); the session's other flags kept.
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if "host_platform_device_count" not in flag)
    single = subprocess.run(_command(tmp_path / "tp1", "--tp=1"), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

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

    tokens, summary = _outputs(tmp_path / "tp1")
    assert sum(map(len, tokens.values())) > 100
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


def test_process_group_names_the_flag_it_lacks():
    with pytest.raises(ValueError, match="--num_processes=2 needs --coordinator=HOST:PORT"):
        distributed.ProcessGroup(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
        distributed.ProcessGroup(coordinator="localhost:1234", num_processes=2, process_id=2)
    distributed.initialize(distributed.ProcessGroup())  # one process: nothing to join
    assert not distributed.is_multiprocess()


def test_descriptor_digest_sees_a_changed_page_or_token():
    def descriptor(pages, tokens):
        return build_step_inputs(Bucket(16, 4), num_tokens=np.array([3, 1]),
                                 num_computed=np.array([0, 5]),
                                 page_rows=np.array(pages, np.int32), page_size=16,
                                 token_ids=np.array(tokens, np.int32))

    base = distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 10]))
    assert base == distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 10]))
    assert base != distributed.descriptor_digest(descriptor([[1, 2], [3, 5]], [7, 8, 9, 10]))
    assert base != distributed.descriptor_digest(descriptor([[1, 2], [3, 4]], [7, 8, 9, 11]))
    assert 0 <= base < 2 ** 31
