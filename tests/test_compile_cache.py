"""The persistent compilation cache: where it lives, and that a hit is the same program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.engine_api import Bucket
from orca_jax.core.packing import build_step_inputs
from orca_jax.model import compile_cache, weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config

BUCKET = Bucket(num_tokens=16, num_seqs=4)


@pytest.fixture
def cache_dir(tmp_path):
    folder = compile_cache.enable(str(tmp_path / "jax-cache"))
    yield folder
    compile_cache.enable(compile_cache.DISABLED)  # later tests compile without it


def test_default_folder_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "orca_jax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "orca_jax" / "jax"


def test_an_uncreatable_folder_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--compile_cache={blocker}/sub: cannot create"):
        compile_cache.enable(str(blocker / "sub"))
    assert compile_cache.current_dir() is None  # nothing changed


def _engine(config, seed):
    return JaxEngine(config, weights.init_params(config, seed=seed), num_cache_pages=12,
                     page_size=4, pages_per_seq=4, attention="bucketed", num_timed_runs=0)


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
