"""The server end to end: `python -m experiments.serve` with `tiny` on a free loopback
port, driven by the OpenAI SDK; then SIGTERM, and its results folder.

One server for the module (its compile is most of the time; the compile cache is
shared with the offline run the answers are compared with).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow  # a real engine's compile
REPO = Path(__file__).resolve().parents[1]
LIMITS = ("--model=tiny", "--max_num_seqs=4", "--max_num_tokens=32", "--max_model_len=256")
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3"]
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    out = tmp / "results"
    log = open(tmp / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.serve", *LIMITS, f"--port={port}",
         f"--out_dir={out}", f"--compile_cache={tmp / 'cache'}", "--max_queued=8",
         # orca, 20 ms a plan: a stream runs long enough to be cancelled mid-answer.
         "--policy=tests/plugins/slow_orca.py:SlowOrca", "--policy_opts=delay_s=0.02"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)),
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None, (tmp / "server.log").read_text()
        time.sleep(0.5)
    yield {"base": base, "process": process, "out": out, "tmp": tmp}
    if process.poll() is None:
        process.kill()


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key="none", max_retries=0)


def _offline_tokens(cache: Path) -> list[list[int]]:
    """The same prompts as an offline run: the same engine and limits (greedy tokens do not
    depend on the policy, so plain orca)."""
    import policies
    from experiments import flags as run_flags
    from orca_jax import Request, Scheduler
    from orca_jax.model import compile_cache
    from orca_jax.runner.build import build_engine, scheduler_config

    run_flags.FLAGS.unparse_flags()
    run_flags.FLAGS(["offline", "--engine=jax", *LIMITS, "--clock=wall"])
    try:
        spec = run_flags.spec_from_flags()
    finally:  # the process's flags as they were: a later test in this worker parses them
        run_flags.FLAGS.unparse_flags()
    compile_cache.enable(str(cache))
    config = scheduler_config(spec)
    requests = [Request(id=i, arrival_s=0.0, prompt_len=len(p.encode()), output_len=MAX_TOKENS,
                        prompt_tokens=list(p.encode())) for i, p in enumerate(PROMPTS)]
    result = Scheduler(requests, policies.make_policy("orca", {}), build_engine(spec, config),
                       config).run()
    return [t.tolist() for t in result.output_tokens]


def test_greedy_completions_equal_an_offline_run_and_streams_end_with_usage(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    served = []
    for prompt in PROMPTS:
        completion = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        choice = completion.choices[0]
        assert choice.finish_reason == "length"
        assert completion.usage.completion_tokens == MAX_TOKENS
        assert completion.usage.prompt_tokens == len(prompt.encode())
        served.append(choice.model_extra["token_ids"])
    assert served == _offline_tokens(server["tmp"] / "cache")
    # Streamed: the same tokens, in order, one chunk per token; usage last, on its own.
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == served[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    # Chat: the same machinery, through the chat rendering.
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3


def test_the_same_seed_gives_the_same_sampled_tokens(server):
    client = _client(server)

    def sample(seed: int) -> list[int]:
        completion = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=1.0,
            seed=seed, extra_body={"return_token_ids": True})
        return completion.choices[0].model_extra["token_ids"]

    first = sample(7)
    assert sample(7) == first  # another row, another batch: the same draws
    assert sample(8) != first  # 512 tokens to draw from, six times: a tie is ~512**-6


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server['base']}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_cancelled_stream_frees_its_pages_and_sigterm_writes_the_results(server):
    body = {"model": "tiny", "prompt": "x" * 8, "max_tokens": 240, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        held = _metrics(server)
        assert held["orca_jax:kv_pages_used"] > 0 and held["orca_jax:num_requests_running"] == 1
    # The client closed the stream: the request is cancelled and its pages freed.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _metrics(server)
        if after["orca_jax:num_requests_outstanding"] == 0:
            break
        time.sleep(0.1)
    assert after["orca_jax:kv_pages_used"] == 0
    assert after["orca_jax:num_requests_running"] == 0
    # SIGTERM while a stream runs: it finishes; a new request meanwhile is answered 503.
    process = server["process"]
    drained: dict = {}
    started = threading.Event()

    def stream_to_the_end() -> None:
        body = {"model": "tiny", "prompt": "y" * 8, "max_tokens": 40, "temperature": 0,
                "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body,
                          timeout=60) as response:
            chunks = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
        drained["tokens"] = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        drained["finish"] = chunks[-1]["choices"][0]["finish_reason"]

    streaming = threading.Thread(target=stream_to_the_end)
    streaming.start()
    assert started.wait(timeout=30)
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server['base']}/health").status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.get(f"{server['base']}/health").json()["status"] == "draining"
    refused = httpx.post(f"{server['base']}/v1/completions",
                         json={"model": "tiny", "prompt": "z", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    streaming.join(timeout=60)
    assert len(drained["tokens"]) == 40 and drained["finish"] == "length"
    # The results written and the lock released before the process ends, with status 0.
    assert process.wait(timeout=60) == 0
    out = server["out"]
    assert not out.with_name(f"{out.name}.lock").exists()
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
    cancelled, last = rows[-2], rows[-1]
    assert cancelled["status"] == "rejected" and cancelled["reason"].startswith("cancelled")
    assert 0 < cancelled["num_generated"] < 240
    assert last["status"] == "finished" and last["num_generated"] == 40
    assert all(r["status"] == "finished" for r in rows[:-2])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "jax" and summary["num_finished"] == len(rows) - 1
