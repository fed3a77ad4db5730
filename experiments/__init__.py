"""The command-line entry points (`python -m experiments.run`, `compare`, `sweep`, ...).

Importing the package keeps JAX's TPU probe line out of their logs (`jax_logs`).
"""

from experiments.jax_logs import quiet_tpu_probe

quiet_tpu_probe()
