"""The server under twice its capacity (benchmarks/serve_load.py, 10 s of flood):
every request answered 200 or 429/503, memory bounded, nothing accepted lost."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from benchmarks.serve_load import load_test  # noqa: E402


@pytest.mark.slow
def test_twice_capacity_is_answered_or_refused_and_nothing_accepted_is_lost(tmp_path):
    r = load_test(tmp_path, duration_s=10.0, overload=2.0)
    assert r["checks"] == {name: True for name in r["checks"]}, r
    assert r["server_rows"] == r["accepted"] == 1 + 8 + r["statuses"]["200"]
