"""The persistent compilation cache: where it lives, and that a hit is the same program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import compile_cache, weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config

BUCKET = Bucket(num_tokens=16, num_seqs=4)


@pytest.fixture
def cache_dir(tmp_path):
    before = compile_cache.current_dir()  # the session's (conftest)
    folder = compile_cache.enable(str(tmp_path / "jax-cache"))
    yield folder
    compile_cache.enable(before or compile_cache.DISABLED)  # later tests use it again


def test_default_folder_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "orca_jax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "orca_jax" / "jax"


def test_an_uncreatable_folder_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    before = compile_cache.current_dir()
    with pytest.raises(ValueError, match=f"--compile_cache={blocker}/sub: cannot create"):
        compile_cache.enable(str(blocker / "sub"))
    assert compile_cache.current_dir() == before  # nothing changed


def _engine(config, seed):
    return JaxEngine(config, weights.init_params(config, seed=seed), num_cache_pages=12,
                     page_size=4, pages_per_seq=4, attention="bucketed")


def test_a_second_engine_loads_the_same_program_from_the_cache(cache_dir):
    config = get_model_config("tiny")
    first = _engine(config, seed=0)
    first.warmup([BUCKET])
    assert first.facts()["compile_cache_hits"] == 0 and not first.facts()["compile_cache_hit"]
    assert any(cache_dir.iterdir())  # written, though it compiled in well under a second
    second = _engine(config, seed=0)
    second.warmup([BUCKET])
    facts = second.facts()
    assert facts["num_compiles"] == 1 and facts["compile_cache_hits"] == 1  # counted alike
    assert facts["compile_cache_hit"] and facts["compile_cache_dir"] == str(cache_dir)
    assert second.fingerprints() == first.fingerprints()
    inputs = build_step_inputs(BUCKET, num_tokens=np.array([5, 3]), num_computed=np.array([0, 0]),
                               page_rows=np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.int32),
                               page_size=4, token_ids=np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(second.step(inputs).sampled_tokens,
                                  first.step(inputs).sampled_tokens)


def test_the_suite_s_command_line_runs_cache_outside_the_user_s_home():
    # What a CLI test's child process (cli_runner, the environment inherited) takes as
    # its default --compile_cache.
    folder = Path(subprocess.run(
        [sys.executable, "-c", "from orca_jax.model import compile_cache; "
                               "print(compile_cache.default_dir())"],
        env=dict(os.environ), capture_output=True, text=True, check=True).stdout.strip())
    home = Path(os.path.expanduser("~")).resolve()
    assert folder.resolve().is_relative_to(Path(os.environ["XDG_CACHE_HOME"]).resolve())
    assert not folder.resolve().is_relative_to(home)


def _step(engine):
    inputs = build_step_inputs(BUCKET, num_tokens=np.array([5, 3]), num_computed=np.array([0, 0]),
                               page_rows=np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.int32),
                               page_size=4, token_ids=np.arange(8, dtype=np.int32))
    return engine.step(inputs).sampled_tokens


def test_a_warm_engine_loads_its_steps_whole_without_tracing(cache_dir, monkeypatch):
    config = get_model_config("tiny")
    first = _engine(config, seed=0)
    first.warmup([BUCKET])
    assert first.facts()["executables_loaded"] == 0
    assert len(list((cache_dir / "executables").iterdir())) == 1
    second = _engine(config, seed=1)  # other weights: arguments, not part of the program

    def no_tracing(*args, **kwargs):
        raise AssertionError("a cached step was traced again")

    monkeypatch.setattr(second._jitted, "lower", no_tracing, raising=False)
    second.warmup([BUCKET])
    facts = second.facts()
    assert facts["executables_loaded"] == 1
    assert facts["num_compiles"] == 1 and facts["compile_cache_hit"]  # counted as before
    assert second.fingerprints() == first.fingerprints()
    third = _engine(config, seed=1)
    with compile_cache_disabled():
        third.warmup([BUCKET])
    assert third.facts()["executables_loaded"] == 0
    np.testing.assert_array_equal(_step(second), _step(third))  # same weights, same tokens


class compile_cache_disabled:
    def __enter__(self):
        self.folder = compile_cache.current_dir()
        compile_cache.enable(compile_cache.DISABLED)

    def __exit__(self, *exc):
        compile_cache.enable(self.folder or compile_cache.DISABLED)


def test_a_step_that_differs_in_any_part_of_its_key_compiles(cache_dir, monkeypatch):
    from orca_jax.model import executable_cache

    config = get_model_config("tiny")
    _engine(config, seed=0).warmup([BUCKET])
    other_op = JaxEngine(config, weights.init_params(config, seed=0), num_cache_pages=12,
                         page_size=4, pages_per_seq=4, attention="reference")
    other_op.warmup([BUCKET])
    wider = _engine(config, seed=0)
    wider.warmup([Bucket(num_tokens=16, num_seqs=8)])
    monkeypatch.setattr(executable_cache, "_source_digest", lambda: "edited source")
    edited = _engine(config, seed=0)
    edited.warmup([BUCKET])
    for engine in (other_op, wider, edited):
        assert engine.facts()["executables_loaded"] == 0
    assert len(list((cache_dir / "executables").iterdir())) == 4


def test_an_unreadable_entry_is_compiled_again_and_replaced(cache_dir, caplog):
    config = get_model_config("tiny")
    first = _engine(config, seed=0)
    first.warmup([BUCKET])
    (entry,) = (cache_dir / "executables").iterdir()
    entry.write_bytes(b"not a pickle")
    second = _engine(config, seed=0)
    second.warmup([BUCKET])
    assert second.facts()["executables_loaded"] == 0
    assert "unreadable" in caplog.text and str(entry) in caplog.text
    assert second.fingerprints() == first.fingerprints()
    third = _engine(config, seed=0)
    third.warmup([BUCKET])  # the entry was written again
    assert third.facts()["executables_loaded"] == 1


def test_the_executable_cache_check_passes_on_this_backend():
    from benchmarks import executable_cache_check

    folder = compile_cache.current_dir()
    assert executable_cache_check.check("tiny", count=6)
    assert compile_cache.current_dir() == folder  # as it found it


def test_the_least_recently_used_entries_go_past_the_size_cap(cache_dir, monkeypatch):
    from orca_jax.model import executable_cache

    config = get_model_config("tiny")
    first = _engine(config, seed=0)
    first.warmup([BUCKET])
    (old_entry,) = (cache_dir / "executables").iterdir()
    os.utime(old_entry, (1, 1))  # long unused
    monkeypatch.setattr(executable_cache, "MAX_BYTES", old_entry.stat().st_size + 1)
    _engine(config, seed=0).warmup([Bucket(num_tokens=16, num_seqs=8)])
    (kept,) = (cache_dir / "executables").iterdir()  # the new one alone fits under the cap
    assert kept != old_entry


def test_a_backend_that_cannot_serialize_keeps_jax_s_cache(cache_dir, monkeypatch, caplog):
    from orca_jax.model import executable_cache

    def cannot(compiled):
        raise NotImplementedError("no serialization here")

    monkeypatch.setattr(executable_cache.serialize_executable, "serialize", cannot)
    monkeypatch.setattr(executable_cache, "_serialize_failed", False)
    config = get_model_config("tiny")
    _engine(config, seed=0).warmup([BUCKET])  # compiled (bypassing JAX's cache), not stored
    assert "do not serialize" in caplog.text and not executable_cache.usable()
    first = _engine(config, seed=0)
    first.warmup([Bucket(num_tokens=16, num_seqs=8)])  # JAX's cache written again
    second = _engine(config, seed=0)
    second.warmup([Bucket(num_tokens=16, num_seqs=8)])
    assert second.facts()["compile_cache_hit"] and second.facts()["executables_loaded"] == 0
    assert not (cache_dir / "executables").exists()
