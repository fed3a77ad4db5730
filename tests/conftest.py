"""Test-wide settings: every test runs on the CPU, whatever machine it is on, the suite
writes nothing into the user's home, and a jax step compiled once in a test session is
loaded, not compiled again, by the later command-line runs and real-engine modules of the
session."""

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


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(CACHE_HOME, ignore_errors=True)
