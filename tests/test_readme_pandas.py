"""The README's "Load results in pandas" section, run exactly as written."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

REPO = Path(__file__).resolve().parent.parent


def _section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("### Load results in pandas")
    end = readme.index("\n## ", start)
    return readme[start:end]


def test_the_readme_s_pandas_code_reads_every_results_file(tmp_path, monkeypatch, capsys):
    section = _section()
    [command] = re.findall(r"\n    (python -m experiments\.compare .*?)\n\n",
                           section.replace("\\\n        ", ""), flags=re.S)
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    run = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=tmp_path,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    summary, latency, table = scope["summary"], scope["latency"], scope["table"]
    # A flat summary reads as a Series of scalars, and its p99 is the rows' p99.
    assert summary["policy"] == "orca" and summary["num_finished"] == 200
    assert latency.quantile(0.99) == pytest.approx(summary["latency_p99_s"])
    assert list(table["policy"]) == ["orca", "vllm"]
    # json_normalize finds nothing nested: its columns are the files' own keys.
    keys = set()
    for policy in ("orca", "vllm"):
        keys |= set(json.loads((tmp_path / "runs/compare" / policy / "summary.json").read_text()))
    assert set(table.columns) == keys
    printed = capsys.readouterr().out
    assert "throughput_tok_s" in printed and "vllm" in printed
