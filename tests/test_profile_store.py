"""The profiled clock's stored tables: one machine and setup, one table, whatever the load.

A clock warmed up against a store reads the table of its key (and times nothing) or
times the grid and stores it; the key holds everything that changes a step's time.
Every store here is in tmp_path.
"""

import json
import logging

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket, Engine, StepOutput
from orca_jax.sim import profile_store, step_profile
from orca_jax.sim.cost_model import attention_tiles, real_lengths
from orca_jax.sim.profile_store import ProfileStore
from orca_jax.sim.profiled_clock import ProfiledClock

BUCKETS = [Bucket(16, 4), Bucket(32, 4)]
GRID = dict(max_model_len=128, page_size=16, pages_per_seq=8, num_pages=32)
IDENTITY = {"model": "tiny", "dtype": "float32", "attention": "reference"}
MACHINE = profile_store.describe_machine("cpu", ["cpu"], "0.0")
SETUP = {"machine": MACHINE, "feed_tokens": True}


class LinearWallEngine(Engine):
    """A 'wall clock' whose step time is a known function of what the step holds, every
    step but each `clean_every`-th slowed by `load` (other processes took the core)."""

    name = "wall"
    needs_token_ids = False

    def __init__(self, base_s=1e-3, per_seq_s=2e-4, per_tile_s=3e-5, load=0.0,
                 clean_every=1) -> None:
        self.coefficients = (base_s, per_seq_s, per_tile_s)
        self.load, self.clean_every = load, clean_every
        self.num_steps = 0

    def _prepare(self, buckets):
        self.warm = set(buckets)

    def seconds(self, inputs) -> float:
        base_s, per_seq_s, per_tile_s = self.coefficients
        q_lens, kv_lens = real_lengths(inputs)
        q_tile, kv_tile = step_profile.reference_tiles(inputs.bucket, GRID["page_size"])
        tiles = attention_tiles(q_lens, kv_lens, q_tile=q_tile, kv_tile=kv_tile)
        return base_s * inputs.bucket.num_tokens / 16 + per_seq_s * q_lens.size + per_tile_s * tiles

    def step(self, inputs):
        self._check_warm(inputs.bucket, self.warm)
        self.num_steps += 1
        slowed = 1.0 + (0.0 if self.num_steps % self.clean_every == 0 else self.load)
        return StepOutput(sampled_tokens=np.zeros(inputs.bucket.num_seqs, np.int32),
                          step_s=self.seconds(inputs) * slowed)


def _clock(store, engine=None, buckets=BUCKETS, grid=GRID, **kwargs):
    clock = ProfiledClock(engine or LinearWallEngine(), **grid, identity=IDENTITY, setup=SETUP,
                          store=store, **kwargs)
    clock.warmup(buckets)
    return clock


def _step(bucket, q_lens, kv_lens, grid=GRID):
    return step_profile.step_inputs(bucket, q_lens, kv_lens, **{
        k: grid[k] for k in ("page_size", "pages_per_seq", "num_pages")})


def test_a_second_clock_of_the_same_key_reads_the_table_and_times_nothing(tmp_path, caplog):
    store = ProfileStore(tmp_path / "store")
    first = _clock(store)
    assert first.num_timed_steps > 0 and not first.table_loaded
    [measured] = first.stored
    assert not measured.reused and measured.machine == MACHINE["name"]
    # Another process on a loaded machine: its steps take twice as long, and are never run.
    busy = LinearWallEngine(base_s=2e-3, per_seq_s=4e-4, per_tile_s=6e-5)
    with caplog.at_level(logging.INFO, logger="orca_jax.sim.profiled_clock"):
        second = _clock(store, busy)
    assert busy.num_steps == 0 and second.num_timed_steps == 0 and second.table_loaded
    [reused] = second.stored
    assert reused.reused and (reused.key, reused.file, reused.measured_at) == (
        measured.key, measured.file, measured.measured_at)
    inputs = _step(BUCKETS[1], [5, 1, 1], [40, 77, 128])
    assert second.step(inputs).step_s == first.step(inputs).step_s  # bit for bit
    lines = [r.getMessage() for r in caplog.records if "profiled clock: table" in r.getMessage()]
    assert lines == [f"profiled clock: table {measured.key} measured "
                     f"{measured.measured_at[:10]} {measured.measured_at[11:16]} on "
                     f"{MACHINE['name']}, reused (--profile_table=fresh to re-measure)"]
    assert [p.name for p in (tmp_path / "store").iterdir()] == [f"{measured.key}.json"]


@pytest.mark.parametrize("change", [
    dict(buckets=[Bucket(16, 4), Bucket(64, 4)]),  # another ladder
    dict(buckets=[Bucket(16, 2), Bucket(32, 4)]),  # another batch width of a bucket
    dict(grid={**GRID, "page_size": 8, "pages_per_seq": 16}),  # another page geometry
])
def test_another_key_times_its_own_table(tmp_path, change):
    store = ProfileStore(tmp_path)
    first = _clock(store)
    engine = LinearWallEngine()
    other = _clock(store, engine, **change)
    assert engine.num_steps == other.num_timed_steps > 0 and not other.table_loaded
    assert other.stored[0].key != first.stored[0].key
    assert len(list(tmp_path.iterdir())) == 2  # the first table stays for its own setup


def test_another_machine_or_compiled_step_is_another_key(tmp_path):
    store = ProfileStore(tmp_path)
    keys = {_clock(store).stored[0].key}
    for setup in ({"machine": {**MACHINE, "num_devices": 2}, "feed_tokens": True},
                  {"machine": MACHINE, "feed_tokens": False}):
        clock = ProfiledClock(LinearWallEngine(), **GRID, identity=IDENTITY, setup=setup,
                              store=store)
        clock.warmup(BUCKETS)
        assert clock.num_timed_steps > 0
        keys.add(clock.stored[0].key)
    assert len(keys) == 3


def test_fresh_times_again_and_replaces_the_stored_table(tmp_path):
    store = ProfileStore(tmp_path)
    first = _clock(store)
    slower = LinearWallEngine(base_s=3e-3)
    fresh = _clock(store, slower, fresh=True)
    assert slower.num_steps == fresh.num_timed_steps > 0 and not fresh.stored[0].reused
    assert fresh.stored[0].key == first.stored[0].key and fresh.fit != first.fit
    later = _clock(store, LinearWallEngine())
    assert later.num_timed_steps == 0 and later.fit == fresh.fit  # the replacement


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"format": "orca_jax.cost_fit/1", "metadata": {}, "buckets": {}}),
    None,  # another key's table copied over this one
])
def test_an_unusable_stored_table_is_one_warning_and_timed_again(tmp_path, caplog, content):
    store = ProfileStore(tmp_path)
    first = _clock(store)
    path = tmp_path / f"{first.stored[0].key}.json"
    if content is None:
        other = _clock(ProfileStore(tmp_path / "other"), buckets=BUCKETS[:1])
        content = (tmp_path / "other" / f"{other.stored[0].key}.json").read_text()
    path.write_text(content)
    engine = LinearWallEngine()
    with caplog.at_level(logging.WARNING):
        again = _clock(store, engine)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    message = warnings[0].getMessage()
    assert message.startswith(f"profiled clock: stored table {path} is unusable (")
    assert message.endswith("); measuring it again") and "\n" not in message
    assert engine.num_steps > 0 and again.fit == first.fit
    assert _clock(store).num_timed_steps == 0  # replaced by a good one


def test_the_fastest_repeat_is_fitted_so_load_does_not_move_the_prices():
    idle = ProfiledClock(LinearWallEngine(), **GRID)
    idle.warmup(BUCKETS)
    # Four steps in five 80% slower: every composition's median and mean move, its
    # fastest repeat does not (the grid's 26 steps a pass put each one's clean step in
    # another pass, so each meets one in 5 passes).
    assert len(step_profile.profile_grid(BUCKETS, **GRID)) % 5 != 0
    loaded = ProfiledClock(LinearWallEngine(load=0.8, clean_every=5), **GRID, num_repeats=5)
    loaded.warmup(BUCKETS)
    for bucket, q_lens, kv_lens in ((BUCKETS[0], [1] * 4, [100] * 4), (BUCKETS[1], [30], [90])):
        inputs = _step(bucket, q_lens, kv_lens)
        assert loaded.step(inputs).step_s == pytest.approx(idle.step(inputs).step_s, rel=1e-6)


def test_a_clock_without_a_store_keeps_nothing(tmp_path):
    clock = _clock(None)
    assert clock.stored == [] and clock.num_timed_steps > 0
    with pytest.raises(ValueError, match="not with a given fit or table_file"):
        ProfiledClock(LinearWallEngine(), **GRID, store=ProfileStore(tmp_path),
                      table_file=str(tmp_path / "t.json"))


def test_the_store_folder_is_a_process_setting_beside_the_compile_cache(monkeypatch, tmp_path):
    from orca_jax.sim.profile_store import current, default_dir, enable

    monkeypatch.setattr(profile_store, "_folder", None)  # restored after the test
    assert current() is None  # a library caller that never enabled one
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "orca_jax" / "profiled_clock"
    assert enable(None) == default_dir() and default_dir().is_dir()
    assert current().folder == default_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"^--profile_store={blocker}/sub: cannot create"):
        enable(str(blocker / "sub"))
    assert current().folder == default_dir()  # unchanged by the rejection
    assert enable("none") is None and current() is None
