"""The context-aware profiled clock: a step is priced by what it holds, the same way every time."""

import re

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket, Engine, EngineConfigError, StepInputs, StepOutput
from orca_jax.sim import step_profile
from orca_jax.sim.cost_model import attention_tiles, real_lengths
from orca_jax.sim.profiled_clock import ProfiledClock

BUCKETS = [Bucket(16, 4), Bucket(64, 8)]
GRID = dict(max_model_len=256, page_size=16, pages_per_seq=16, num_pages=64)


class LinearWallEngine(Engine):
    """A 'wall clock' whose step time is a known function of the step's composition."""

    def __init__(self, base_s=1e-3, per_seq_s=2e-4, per_tile_s=3e-5) -> None:
        self.coefficients = (base_s, per_seq_s, per_tile_s)
        self.num_steps = 0

    name = "wall"
    needs_token_ids = False

    def _prepare(self, buckets):
        self.warm = set(buckets)

    def seconds(self, inputs: StepInputs) -> float:
        base_s, per_seq_s, per_tile_s = self.coefficients
        q_lens, kv_lens = real_lengths(inputs)
        q_tile, kv_tile = step_profile.reference_tiles(inputs.bucket, GRID["page_size"])
        tiles = attention_tiles(q_lens, kv_lens, q_tile=q_tile, kv_tile=kv_tile)
        return base_s * inputs.bucket.num_tokens / 16 + per_seq_s * q_lens.size + per_tile_s * tiles

    def step(self, inputs):
        self._check_warm(inputs.bucket, self.warm)
        self.num_steps += 1
        return StepOutput(sampled_tokens=np.full(inputs.bucket.num_seqs, 7, np.int32),
                          step_s=self.seconds(inputs))


def _step(bucket, q_lens, kv_lens):
    return step_profile.step_inputs(bucket, q_lens, kv_lens, **{
        k: GRID[k] for k in ("page_size", "pages_per_seq", "num_pages")})


def test_prices_follow_the_steps_real_sequences_not_the_bucket():
    wall = LinearWallEngine()
    clock = ProfiledClock(wall, **GRID)
    clock.warmup(BUCKETS)
    assert wall.num_steps > 0 and sorted(clock.fit) == [16, 64]
    rng = np.random.default_rng(0)
    for _ in range(20):
        bucket = BUCKETS[int(rng.integers(2))]
        n = int(rng.integers(1, bucket.num_seqs + 1))
        q = rng.integers(1, bucket.num_tokens // n + 1, size=n)
        k = np.minimum(q + rng.integers(0, 200, size=n), 256)
        inputs = _step(bucket, q.tolist(), k.tolist())
        output = clock.step(inputs)
        assert output.step_s == pytest.approx(wall.seconds(inputs), rel=1e-6)
        assert (output.sampled_tokens == 7).all()  # the wrapped engine's tokens, untouched
    # One short decode and a bucket of long ones are priced apart, in the same bucket.
    short, long = _step(BUCKETS[1], [1], [32]), _step(BUCKETS[1], [1] * 8, [256] * 8)
    gap = clock.step(long).step_s - clock.step(short).step_s
    assert gap > 1e-3 and gap == pytest.approx(wall.seconds(long) - wall.seconds(short))


def test_the_same_step_costs_the_same_and_a_saved_fit_prices_identically():
    clock = ProfiledClock(LinearWallEngine(), **GRID)
    clock.warmup(BUCKETS)
    inputs = _step(BUCKETS[0], [3, 1], [3, 40])
    assert clock.step(inputs).step_s == clock.step(inputs).step_s
    noisy = LinearWallEngine(base_s=5.0)  # another machine: a given fit ignores its times
    reused = ProfiledClock(noisy, fit=clock.fit, **GRID)
    reused.warmup(BUCKETS)
    assert noisy.num_steps == 0  # nothing profiled
    assert reused.step(inputs).step_s == clock.step(inputs).step_s


def test_a_given_fit_must_cover_every_bucket_and_steps_need_warm_buckets():
    clock = ProfiledClock(LinearWallEngine(), **GRID)
    with pytest.raises(ValueError, match="was not warmed up"):
        clock.step(_step(BUCKETS[0], [1], [8]))
    clock.warmup(BUCKETS[:1])
    partial = ProfiledClock(LinearWallEngine(), fit=clock.fit, **GRID)
    with pytest.raises(ValueError, match=r"no price for buckets \[64\]"):
        partial.warmup(BUCKETS)


IDENTITY = {"model": "tiny", "dtype": "float32", "attention": "reference"}


def test_a_table_file_is_written_when_missing_and_read_back_to_price_alike(tmp_path):
    path = str(tmp_path / "table.json")
    wall = LinearWallEngine()
    first = ProfiledClock(wall, **GRID, table_file=path, identity=IDENTITY)
    assert not first.table_loaded
    first.warmup(BUCKETS)
    assert (tmp_path / "table.json").exists() and wall.num_steps > 0
    # Another "process": a wall clock with other coefficients is never timed.
    other = LinearWallEngine(base_s=9e-3, per_seq_s=0.0, per_tile_s=0.0)
    second = ProfiledClock(other, **GRID, table_file=path, identity=IDENTITY)
    assert second.table_loaded
    second.warmup(BUCKETS)
    assert other.num_steps == 0 and second.fit == first.fit
    inputs = _step(BUCKETS[1], [5, 40, 1], [200, 40, 77])
    assert second.step(inputs).step_s == first.step(inputs).step_s  # bit for bit


@pytest.mark.parametrize("change, says", [
    (dict(identity={**IDENTITY, "dtype": "bfloat16"}),
     "another setup: dtype='float32' (this run: 'bfloat16')"),
    (dict(identity={**IDENTITY, "attention": "pallas"}), "attention='reference' (this run: "),
    (dict(page_size=8), "another setup: page_size=16 (this run: 8)"),
])
def test_a_table_of_another_setup_is_refused_naming_the_field(tmp_path, change, says):
    path = str(tmp_path / "table.json")
    ProfiledClock(LinearWallEngine(), **GRID, table_file=path, identity=IDENTITY).warmup(BUCKETS)
    kwargs = {**GRID, "identity": IDENTITY, **change}
    with pytest.raises(EngineConfigError, match=f"profile table {path} .*{re.escape(says)}"):
        ProfiledClock(LinearWallEngine(), table_file=path, **kwargs)


def test_a_table_of_other_buckets_or_no_table_at_all_is_refused(tmp_path):
    path = str(tmp_path / "table.json")
    ProfiledClock(LinearWallEngine(), **GRID, table_file=path).warmup(BUCKETS[:1])
    clock = ProfiledClock(LinearWallEngine(), **GRID, table_file=path)
    with pytest.raises(EngineConfigError, match=r"has buckets \[16\], this run has \[16, 64\]"):
        clock.warmup(BUCKETS)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(EngineConfigError, match="junk.json: .*not JSON"):
        ProfiledClock(LinearWallEngine(), **GRID, table_file=str(tmp_path / "junk.json"))
