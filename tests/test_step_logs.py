"""A run's steps, packed into arrays as they come, read back as the StepLogs appended."""

import numpy as np
import pytest

from orca_jax.core.requests import step_logs
from orca_jax.core.requests.step_logs import StepLog, StepLogs


def _step(i: int) -> StepLog:
    return StepLog(step=i, start_s=0.1 * i, num_seqs=i % 5, num_tokens=3 * i,
                   num_padded_tokens=4 * i, bucket=16, host_s=1e-4 / (i + 1),
                   step_s=float("inf") if i == 7 else 0.02, num_running=i, num_waiting=2,
                   num_free_pages=10 ** 12, num_cached_tokens=i % 2)


def test_packed_steps_read_back_as_appended(monkeypatch):
    monkeypatch.setattr(step_logs, "PACK_STEPS", 4)  # a few packs, and a tail
    steps = [_step(i) for i in range(11)]
    logs = StepLogs()
    for step in steps:
        logs.append(step)
    assert len(logs) == 11 and logs == steps and list(logs) == steps
    assert logs[5] == steps[5] and logs[-1] == steps[-1] and logs[3:9] == steps[3:9]
    assert [tuple(map(type, s)) for s in logs] == [tuple(map(type, s)) for s in steps]
    np.testing.assert_array_equal(logs.column("step_s"), [s.step_s for s in steps])
    frozen = logs.frozen()
    logs.append(_step(11))  # the live log goes on; the frozen copy does not
    assert frozen == steps and len(logs) == 12
    with pytest.raises(ValueError, match="finished run"):
        frozen.append(_step(12))
    assert StepLogs.concat([frozen, logs]) == steps + steps + [_step(11)]
    with pytest.raises(IndexError):
        frozen[11]


def test_last_is_the_newest_step_packed_or_not(monkeypatch):
    monkeypatch.setattr(step_logs, "PACK_STEPS", 4)
    logs = StepLogs()
    with pytest.raises(IndexError):
        logs.last()
    for i in range(9):
        logs.append(_step(i))
        # Right after a pack (4, 8 steps) the tail is empty: read from the packed rows.
        assert logs.last() == logs[-1] == _step(i)
        assert tuple(map(type, logs.last())) == tuple(map(type, _step(i)))
