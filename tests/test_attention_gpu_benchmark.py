"""benchmarks/attention_gpu.py runs end to end on a CPU (`--tiny`, interpret mode), so the
GPU check is known to work before a GPU is at hand, and its correctness gate can fail."""

from __future__ import annotations

import re

import jax.numpy as jnp

from benchmarks import attention_gpu
from pallas_kernels import ragged_paged_attention as rpa


def test_tiny_run_checks_times_and_writes_its_output(tmp_path):
    out = tmp_path / "attention.txt"
    assert attention_gpu.main(["--tiny", "--budget", "0.01", "--out", str(out)]) == 0
    text = out.read_text()
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"{dtype} kernel:tables\s+rel err \d\.\d\de-\d\d", text)
    summary = text.split("summary")[1]
    assert {"kernel:tables", "reference", "dense"} <= set(re.findall(r"mixed\s+(\S+)", summary))
    assert text.rstrip().endswith("correctness: all passed")


def test_correctness_gate_flags_a_wrong_kernel(monkeypatch):
    def off_by_ten_percent(*, config=None, interpret=False, **kwargs):
        return (rpa.ragged_paged_attention_reference(**kwargs) * 1.1).astype(kwargs["q"].dtype)

    monkeypatch.setattr(rpa, "ragged_paged_attention", off_by_ten_percent)
    case = attention_gpu.make_case("check", [1, 1, 5], [9, 30, 12], jnp.float32, poison=True)
    failures = attention_gpu.check(case, True, ["tables"], lambda line: None)
    assert len(failures) == 1 and failures[0].startswith("kernel:tables float32: rel err 1.00e-01")
