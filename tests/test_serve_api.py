"""The server's API without the engine running: errors, limits, metrics, stop strings,
and the scheduler's cancel and stop. Fast: the simulator stands in for the engine
(nothing is stepped but in the scheduler tests)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import policies  # noqa: E402
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits  # noqa: E402
from orca_jax.core.requests.request import RequestState  # noqa: E402
from orca_jax.serving.app import _Answer, create_app  # noqa: E402
from orca_jax.serving.live import (  # noqa: E402
    PLACEHOLDER_ARRIVAL_S,
    LiveRun,
    QueueFull,
    Submission,
)
from orca_jax.serving.metrics import ServingMetrics  # noqa: E402
from orca_jax.serving.tokenizer import ByteTokenizer, Detokenizer  # noqa: E402
from orca_jax.sim.cost_model import CostModelConfig  # noqa: E402
from orca_jax.sim.engine import SimEngine  # noqa: E402

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=2, max_num_tokens=32, max_model_len=64),
                         kv=KVConfig(num_kv_pages=32, page_size=4))


def _live(max_outstanding: int = 4) -> LiveRun:
    return LiveRun(policies.make_policy("orca", {}),
                   SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG,
                   capacity=8, max_outstanding=max_outstanding)


def _client(live: LiveRun, **kwargs) -> TestClient:
    return TestClient(create_app(live, ByteTokenizer(512), model_name="tiny",
                                 max_model_len=64, vocab_size=512, metrics=ServingMetrics(),
                                 **kwargs))


def _error(response, status: int, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"]
    return error


def test_bad_requests_get_400_naming_the_field():
    client = _client(_live())
    url = "/v1/completions"
    response = client.post(url, content=b'{"model": "tiny", "prompt": ', headers={
        "content-type": "application/json"})
    assert "not valid JSON" in _error(response, 400, None)["message"]
    _error(client.post(url, json={"model": "tiny", "prompt": "hi", "temperature": "x"}), 400,
           "temperature")
    _error(client.post(url, json={"model": "tiny", "prompt": "hi", "top_p": 0}), 400, "top_p")
    _error(client.post(url, json={"model": "tiny"}), 400, "prompt")
    _error(client.post(url, json={"model": "tiny", "prompt": "hi", "n": 2}), 400, "n")
    # 64 tokens of context: a prompt of 64 leaves none; 60 leaves 4 for the answer.
    _error(client.post(url, json={"model": "tiny", "prompt": "a" * 64}), 400, "prompt")
    error = _error(client.post(url, json={"model": "tiny", "prompt": "a" * 60,
                                          "max_tokens": 5}), 400, "max_tokens")
    assert "at most 4" in error["message"]
    _error(client.post(url, json={"model": "tiny", "prompt": [1, 600]}), 400, "prompt")
    _error(client.post(url, json={"model": "other", "prompt": "hi"}), 404, "model")
    _error(client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}), 400,
        "messages.0.role")
    _error(client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 100}), 400, "max_completion_tokens")


def test_a_full_server_answers_429_and_an_api_key_is_checked():
    live = _live(max_outstanding=1)
    client = _client(live, api_key="sekret")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.get("/v1/models").status_code == 401
    auth = {"authorization": "Bearer sekret"}
    models = client.get("/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    # The engine thread is not started: the one request held stays held.
    live.submit(Submission([1, 2], 2, 0.0, 1.0, lambda event: None))
    with pytest.raises(QueueFull):
        live.submit(Submission([1, 2], 2, 0.0, 1.0, lambda event: None))
    response = client.post("/v1/completions", json=body, headers=auth)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert client.get("/health").status_code == 200  # no key for health and metrics


def test_metrics_parse_as_prometheus_text():
    live = _live()
    metrics = ServingMetrics()
    metrics.iteration(live)
    metrics.first_token(0.05)
    metrics.tokens(3, 0.01)
    client = TestClient(create_app(live, ByteTokenizer(512), model_name="tiny",
                                   max_model_len=64, vocab_size=512, metrics=metrics))
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    value = {s.name: s.value for f in families.values() for s in f.samples}
    assert value["orca_jax:kv_pages_free"] == 32
    assert value["orca_jax:kv_pages_used"] == 0
    assert value["orca_jax:generation_tokens_total"] == 4
    assert value["orca_jax:time_to_first_token_seconds_count"] == 1
    assert value["orca_jax:inter_token_latency_seconds_count"] == 3
    assert {"orca_jax:num_requests_waiting", "orca_jax:num_requests_running",
            "orca_jax:num_preemptions", "orca_jax:generation_tokens_per_second"} <= set(value)


class _FakeLive:
    def __init__(self):
        self.stopped = []

    def stop(self, row):
        self.stopped.append(row)


def test_a_stop_string_across_two_events_ends_the_answer_before_it():
    live = _FakeLive()
    answer = _Answer(live, 7, ByteTokenizer(512), ["STOP"], eos=None)
    handed = []
    for piece in ("abc S", "TO", "P tail"):
        text, _ = answer.take(("tokens", list(piece.encode())))
        handed.append(text)
    assert "".join(handed) == answer.text == "abc "
    assert answer.finished and answer.finish_reason == "stop" and live.stopped == [7]


def test_the_detokenizer_waits_for_a_whole_character():
    detokenizer = Detokenizer(ByteTokenizer(512))
    euro = "€".encode()
    assert detokenizer.add([euro[0]]) == ""
    assert detokenizer.add(list(euro[1:])) == "€"


def _scheduler() -> Scheduler:
    requests = [Request(id=i, arrival_s=0.0, prompt_len=8, output_len=6) for i in range(3)]
    return Scheduler(requests, policies.make_policy("vllm", {}),
                     SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG)


def test_cancel_frees_the_pages_and_tells_the_policy():
    scheduler = _scheduler()
    for _ in range(3):
        scheduler.step()
    assert scheduler.running.tolist() == [0, 1]
    used = scheduler.kv.num_used
    held = int(scheduler.kv.num_held[1])
    generated = int(scheduler.table.num_generated[1])
    assert scheduler.cancel([1], "cancelled: gone") == 1
    assert scheduler.kv.num_used == used - held and held > 0
    assert scheduler.table.state[1] == RequestState.REJECTED
    assert scheduler.table.reject_reason[1] == "cancelled: gone"
    assert 1 in scheduler.view.last_finished and 1 not in scheduler.running
    assert scheduler.cancel([1], "again") == 0  # done already: nothing changes
    result = scheduler.run()
    assert result.state.tolist() == [RequestState.FINISHED, RequestState.REJECTED,
                                     RequestState.FINISHED]
    assert result.num_generated.tolist() == [6, generated, 6]  # no token after


def test_stop_finishes_with_the_tokens_so_far():
    scheduler = _scheduler()
    for _ in range(3):
        scheduler.step()
    generated = int(scheduler.table.num_generated[0])
    assert 0 < generated < 6
    assert scheduler.stop([0, 2]) == 2
    table = scheduler.table
    assert table.state[0] == RequestState.FINISHED and table.output_len[0] == generated
    # Request 2 had no token yet: stopped before its first, it is cancelled.
    assert table.state[2] == RequestState.REJECTED
    assert scheduler.kv.num_held[0] == 0 and scheduler.kv.num_held[2] == 0
    result = scheduler.run()
    assert result.output_len.tolist() == [generated, 6, 6]
    assert result.num_generated.tolist()[:2] == [generated, 6]


def test_what_the_server_cannot_honour_is_refused_naming_the_field():
    # No request is held (max_outstanding 0): a body the server takes is answered 429, one
    # it refuses 400, so each answer says which it was without running the engine.
    client = _client(_live(max_outstanding=0))
    url = "/v1/completions"
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for field, value in [("logprobs", 1), ("logprobs", 0), ("best_of", 2), ("echo", True),
                         ("presence_penalty", 0.5), ("logit_bias", {"5": 1.0}),
                         ("suffix", "end")]:
        error = _error(client.post(url, json={**base, field: value}), 400, field)
        assert error["code"] == "unsupported_value", (field, error)
    error = _error(client.post(url, json={**base, "frobnicate": 1}), 400, "frobnicate")
    assert error["code"] == "unsupported_field"
    _error(client.post(url, json={**base, "stream": "yes"}), 400, "stream")
    _error(client.post(url, json={**base, "stream": 1}), 400, "stream")
    _error(client.post(url, json={**base, "seed": -1}), 400, "seed")
    _error(client.post(url, json={**base, "seed": 2**32}), 400, "seed")
    _error(client.post(url, json={**base, "stream_options": {"include_usage": "no"}}), 400,
           "stream_options.include_usage")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(client.post("/v1/chat/completions", json={**chat, "logprobs": True}), 400,
           "logprobs")
    _error(client.post("/v1/chat/completions", json={**chat, "tools": []}), 400, "tools")
    # What asks for nothing is served: a client's defaults (vLLM's benchmark client sends
    # logprobs null and repetition_penalty 1.0), a seed, a user's name.
    taken = {**base, "logprobs": None, "best_of": 1, "echo": False, "presence_penalty": 0,
             "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
             "user": "me", "seed": 2**32 - 1, "stream": False}
    response = client.post(url, json=taken)
    assert response.status_code == 429, response.text
    assert client.post("/v1/chat/completions",
                       json={**chat, "logprobs": False, "top_logprobs": 0}).status_code == 429


def test_every_error_is_openais_shape_and_429_says_when_to_retry():
    live = _live(max_outstanding=0)
    client = TestClient(create_app(live, _RaisingTokenizer(512), model_name="tiny",
                                   max_model_len=64, vocab_size=512),
                        raise_server_exceptions=False)
    _error(client.get("/v1/nope"), 404, None)
    error = _error(client.get("/v1/completions"), 405, None)
    assert error["type"] == "invalid_request_error"
    error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "boom"}),
                   500, None)
    assert error["type"] == "server_error" and "tokenizer broke" in error["message"]
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
    _error(response, 429, None)
    assert response.headers["retry-after"] == "1"


class _RaisingTokenizer(ByteTokenizer):
    def encode(self, text):
        raise RuntimeError("tokenizer broke")


def test_health_says_ok_then_draining_and_new_requests_get_503_while_draining():
    live = _live()
    client = _client(live)
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": "tiny", "num_outstanding": 0}
    live.submit(Submission([1, 2], 2, 0.0, 1.0, lambda event: None))  # held: not stepped
    live.refuse_new()
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "draining", "num_outstanding": 1}
    error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                        "max_tokens": 2}), 503, None)
    assert "shutting down" in error["message"] and error["code"] == "unavailable"


def test_a_requests_seed_is_its_sampling_seed_and_others_keep_the_runs():
    live = _live()
    before = live.scheduler.sampling.rng_seeds.copy()
    first = live.submit(Submission([1, 2], 2, 1.0, 1.0, lambda event: None, seed=7))
    second = live.submit(Submission([1, 2], 2, 1.0, 1.0, lambda event: None))
    live.start()  # the engine thread takes both in: their rows get real arrival times
    try:
        deadline = time.monotonic() + 10
        while (live.scheduler.table.arrival_s[second] == PLACEHOLDER_ARRIVAL_S
               and time.monotonic() < deadline):
            time.sleep(0.01)
    finally:
        live.drain(timeout_s=0)
    seeds = live.scheduler.sampling.rng_seeds
    assert seeds[first] == 7 and seeds[second] == before[second] != 7
