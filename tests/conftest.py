"""Test-wide settings: every test runs on the CPU, whatever machine it is on."""

import os

# Pinned before jax is imported anywhere: on a GPU machine interpret-mode Pallas
# would otherwise run on the GPU, and timings would differ from CI's.
os.environ["JAX_PLATFORMS"] = "cpu"
