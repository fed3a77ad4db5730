"""Test-wide settings: every test runs on the CPU, whatever machine it is on, and the
suite writes nothing into the user's home."""

import os
import shutil
import tempfile

# Pinned before jax is imported anywhere: on a GPU machine interpret-mode Pallas
# would otherwise run on the GPU, and timings would differ from CI's.
os.environ["JAX_PLATFORMS"] = "cpu"

# The command-line runs (here and in the child processes the CLI tests start, which
# inherit the environment) enable JAX's compile cache in its default folder,
# $XDG_CACHE_HOME/orca_jax/jax, else ~/.cache/orca_jax/jax: a temporary folder for the
# session instead. Whatever else follows XDG_CACHE_HOME (matplotlib's font cache) goes
# there too.
CACHE_HOME = tempfile.mkdtemp(prefix="orca_jax_tests_cache_")
os.environ["XDG_CACHE_HOME"] = CACHE_HOME


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_HOME, ignore_errors=True)
