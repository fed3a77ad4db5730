"""What `experiments.serve` cannot do is refused in one line, exit status 2, before the engine
compiles, with nothing written: a port in use, a host that does not resolve, a workload or
cluster flag (the requests are the clients', on one replica). Each command runs as its own
process, forked from one that imported the entry points once (`forked_cli`)."""

from __future__ import annotations

import os
import re
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

LIMITS = ("--model=tiny", "--max_num_seqs=2", "--max_num_tokens=32", "--max_model_len=64")


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


CASES = {
    "busy_port": (lambda port: (f"--port={port}",),
                  r"^error: --port=(\d+): cannot listen on 127\.0\.0\.1:\1: Address already in "
                  r"use$"),
    "unknown_host": (lambda port: ("--host=no-such-host.invalid",),
                     r"^error: --host=no-such-host\.invalid: cannot resolve it"),
    "trace_workload": (lambda port: ("--workload=trace", "--trace=/nonexistent.csv"),
                       r"^error: --workload=trace --trace=/nonexistent\.csv: serve takes its "
                       r"requests from its clients and reads no workload flag"),
    "two_replicas": (lambda port: ("--num_replicas=2",),
                     r"^error: --num_replicas=2: serve runs one replica"),
    "noleap": (lambda port: ("--noleap",),
               r"^error: --noleap is a setting of the sim engine only; --engine=jax does not "
               r"read it"),
}


@pytest.fixture(scope="module")
def outcomes(busy_port, tmp_path_factory):
    from forked_cli import run_forked

    outs = tmp_path_factory.mktemp("outs")
    commands = [("experiments.serve", (*LIMITS, *make(busy_port), f"--out_dir={outs / name}"))
                for name, (make, _) in CASES.items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    results = run_forked(commands, tmp_path_factory.mktemp("streams"), env)
    return outs, dict(zip(CASES, results))


@pytest.mark.parametrize("name", list(CASES))
def test_serve_refuses_in_one_line_before_compiling_and_writes_nothing(outcomes, name):
    outs, results = outcomes
    result = results[name]
    lines = [line for line in result.stderr.splitlines() if line.strip()
             and not line.startswith(("WARNING: All log messages before", "E0000", "W0000"))]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and re.search(CASES[name][1], lines[0]), result.stderr
    assert "compiling" not in result.stdout
    assert not any(outs.iterdir()), sorted(p.name for p in outs.iterdir())  # not even a lock
