"""Keeps JAX's TPU probe out of the entry points' logs where no TPU runtime is installed.

With JAX_PLATFORMS unset, JAX tries every backend it knows when it first needs one, TPU
included, and where the TPU runtime (libtpu) is not installed it logs at INFO
"Unable to initialize backend 'tpu': ... Failed to open libtpu.so". The entry points log
at absl's INFO (their progress lines), so every run that used jax on a CPU or GPU printed
that line. `quiet_tpu_probe` drops exactly it: a TPU runtime that is installed and fails
still says so, and nothing else of JAX's logging changes. Pure logging: no jax import.
"""

from __future__ import annotations

import logging

PROBE_LOGGER = "jax._src.xla_bridge"  # the module that probes the backends


class _NoTPURuntime(logging.Filter):
    """Drops JAX's note that the TPU backend failed because libtpu is not installed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Unable to initialize backend 'tpu'")
                    and "libtpu.so" in message)


def quiet_tpu_probe() -> None:
    """Installs the filter on JAX's backend-probe logger (once; before or after jax loads)."""
    logger = logging.getLogger(PROBE_LOGGER)
    if not any(isinstance(f, _NoTPURuntime) for f in logger.filters):
        logger.addFilter(_NoTPURuntime())
