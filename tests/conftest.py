"""Test-wide settings: every test runs on the CPU, whatever machine it is on, the suite
writes nothing into the user's home, and a jax step compiled once in a test session is
loaded, not compiled again, by the later command-line runs and real-engine modules of the
session."""

import gc
import os
import shutil
import sys
import tempfile

import pytest

# Pinned before jax is imported anywhere: on a GPU machine interpret-mode Pallas
# would otherwise run on the GPU, and timings would differ from CI's.
os.environ["JAX_PLATFORMS"] = "cpu"

# XLA's CPU backend compiles with LLVM at -O0 in the test session (its HLO passes, fusion
# and the matmul library calls are the same): most of the suite's time is compiling
# programs that run a few steps, and this halves a `tiny` step's compile (4.3 -> 2.1 s)
# and cuts test_ragged_paged_attention's CPU time by a third (138 -> 90 s user). Child
# processes inherit it; the tests that set XLA_FLAGS for them append to it.
# Speed is measured in benchmarks/, never here, so the slower code costs nothing.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# The command-line runs (here and in the child processes the CLI tests start, which
# inherit the environment) enable JAX's compile cache in its default folder,
# $XDG_CACHE_HOME/orca_jax/jax, else ~/.cache/orca_jax/jax: a temporary folder for the
# session instead. Whatever else follows XDG_CACHE_HOME (matplotlib's font cache) goes
# there too. One folder for the whole session: pytest-xdist's workers start with the
# environment of the process that made it (which alone removes it at the end), so their
# tests and child processes load the programs any of them compiled.
_SESSION_CACHE = "ORCA_JAX_TESTS_CACHE_HOME"
_OWNER = _SESSION_CACHE not in os.environ
if _OWNER:
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="orca_jax_tests_cache_")
CACHE_HOME = os.environ[_SESSION_CACHE]
os.environ["XDG_CACHE_HOME"] = CACHE_HOME

# Bytecode is written: where PYTHONDONTWRITEBYTECODE is set (some machines set it for
# every process) each command-line run a test starts would compile the project's sources
# again, about 0.3 s of a 0.5 s one-request run. Not under a PYTHONPYCACHEPREFIX: the
# installed libraries' own bytecode would then go unread and be compiled again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="module")
def session_compile_cache():
    """For a module of real-engine runs (`pytestmark = pytest.mark.usefixtures(
    "session_compile_cache")`): the engines built in this process use that folder too, as
    a command-line run does by default, JAX's persistent cache and the engine's executable
    cache (a loaded program counts the compiles it took, so compile counts do not change).
    Most of such a test's time is compiling `tiny` steps another test already compiled.
    Only those modules: every other program compiled in the session (the kernels' many
    shapes) would be written to disk for nothing. Restored when the module ends."""
    from orca_jax.model import compile_cache

    before = compile_cache.current_dir()
    compile_cache.enable(None)
    yield
    compile_cache.enable(before or compile_cache.DISABLED)


# pytest-xdist's `--dist loadfile` hands out the files in order of their number of tests,
# most first, and many of the slowest files (a few end-to-end runs of the real engine
# each) have few: they went out late (test_pipeline_engine_cli, one test of ~30 s, among
# the last five), and a worker could run one while the other had finished. The files
# that take longest go out first instead, largest first, so the many short files fill in
# at the end: ranked by a whole `-n 2 --dist loadfile` run's seconds a file
# (benchmarks/results/suitetime5_durations.txt, which replays both orders); the rest keep
# xdist's order. A name here that no longer exists is skipped; a new slow file belongs here.
SLOWEST_FILES = (
    "test_scheduler_invariants.py", "test_prefix_caching_switch.py", "test_experiments_cli.py",
    "test_ragged_paged_attention.py", "test_compile_cache.py", "test_tensor_parallel.py",
    "test_sweep_ray.py", "test_leap.py", "test_decisions_frozen.py", "test_spec_engine.py",
    "test_gpu_check.py", "test_spec_sampling.py", "test_compare_equal_settings.py",
    "test_entry_points.py", "test_sweep_variants.py", "test_overlap.py",
    "test_autellix_reproduction.py", "test_cached_attention.py", "test_cli_errors.py",
    "test_migration_engine_processes.py", "test_driving_experiments.py",
    "test_pipeline_engine_cli.py", "test_engine_kv_tiers.py", "test_model.py",
    "test_ranker.py", "test_disaggregated_invariants.py", "test_row_lines.py",
    "test_architecture.py", "test_reproductions.py", "test_serve.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowestFilesFirst(LoadFileScheduling):
        _reordered = False

        def _assign_work_unit(self, node):
            queue = getattr(self, "workqueue", None)  # xdist 3.x's; else its own order
            if not self._reordered and hasattr(queue, "move_to_end"):
                # The first file handed out: the queue is complete.
                self._reordered = True
                rank = {f"tests/{name}": i for i, name in enumerate(SLOWEST_FILES)}
                for scope in sorted(queue, key=lambda s: rank.get(s, len(rank))):
                    queue.move_to_end(scope)
            super()._assign_work_unit(node)

    return SlowestFilesFirst(config, log)


def pytest_collection_finish(session):
    """Every object the collection made (the imported modules: jax, numpy, the framework,
    the tests' own tables) moves to the collector's permanent generation, which a full
    collection no longer walks. run_policy collects the finished run's cycles
    (`gc.collect()`, for a 10^6-request run's peak), and in a test process that walk of
    every imported object was ~0.1 s a run: 11 of 77 s of test_scheduler_invariants'
    pipeline and rerun tests. What the tests make later is collected as before."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(CACHE_HOME, ignore_errors=True)
