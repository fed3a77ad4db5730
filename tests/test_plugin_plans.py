"""A plugin's malformed plan ends its run in one line naming the policy and rule `not_a_plan`
(exit 1, as any broken plan rule), with the line that built it; never the framework's
traceback (issue 25: `StepPlan([], [1])` and NaN counts got it). Each rule case, and the
state left unchanged, is in tests/test_plan_rules.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "plugins" / "malformed_plans.py"
BUILT_AT = next(i for i, line in enumerate(PLUGINS.read_text().splitlines(), 1)
                if "# BUILT HERE" in line)


def _run(cls: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--num_requests=3",
         "--bucket_ladder=pow2", f"--policy={PLUGINS}:{cls}", f"--out_dir={out}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120)


@pytest.mark.parametrize("cls, says", [
    ("LengthsDiffer", r"StepPlan: 0 request_ids but 1 num_tokens \(StepPlan built at "
                      rf".*malformed_plans\.py:{BUILT_AT}\)"),
    ("NaNTokens", r"StepPlan\.num_tokens must be a 1-D sequence of integers, got float64 with "
                  r"shape \(1,\) \(NaN among them\)"),
    ("TextIds", r"StepPlan\.request_ids must be a 1-D sequence of integers, got <U1"),
])
def test_a_malformed_plan_is_one_line_naming_policy_and_rule(cls, says, tmp_path):
    done = _run(cls, tmp_path / "out")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: policy '{cls.lower()}' broke rule 'not_a_plan': "), line
    assert re.search(says, line), line
    assert not (tmp_path / "out" / "summary.json").exists()
