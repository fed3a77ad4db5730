"""No JAX TPU-probe line in a CPU or GPU run's log (issue 25: every --engine=jax run printed
"Unable to initialize backend 'tpu': ... Failed to open libtpu.so")."""

import logging
import os
import subprocess
import sys
from pathlib import Path

from experiments.jax_logs import PROBE_LOGGER, quiet_tpu_probe

REPO = Path(__file__).resolve().parents[1]
PROBE_LINE = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: "
              "libtpu.so: cannot open shared object file: No such file or directory")


def test_a_jax_run_without_jax_platforms_logs_no_tpu_probe(tmp_path):
    # JAX probes the TPU only when JAX_PLATFORMS is unset: as a user runs it.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=jax", "--num_requests=2",
         "--max_num_tokens=16", "--max_num_seqs=2", f"--out_dir={tmp_path / 'out'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "jax engine: compiling" in done.stderr  # the run's own INFO lines still show
    probe = [line for line in done.stderr.splitlines()
             if "Unable to initialize backend 'tpu'" in line and "libtpu.so" in line]
    assert probe == []


def test_only_the_missing_runtime_line_is_dropped(caplog):
    quiet_tpu_probe()
    quiet_tpu_probe()  # once is enough: no second filter
    logger = logging.getLogger(PROBE_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=PROBE_LOGGER):
        logger.info(PROBE_LINE)
        logger.info("Unable to initialize backend 'tpu': TPU initialization failed: busy")
        logger.info("Unable to initialize backend 'cuda': no CUDA devices")
    assert [r.getMessage() for r in caplog.records] == [
        "Unable to initialize backend 'tpu': TPU initialization failed: busy",
        "Unable to initialize backend 'cuda': no CUDA devices"]
