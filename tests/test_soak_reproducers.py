"""The outside soak's reproducers (issue 51), each run as a user runs it: it finishes with
the right results, or refuses in one line naming the thing with nothing half-written.

The commands run as processes of their own, forked from one that imported the entry
points once (`forked_cli`), two at a time; each case checks its own outcome.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

import pytest

SIM = ("--engine=sim",)


@dataclasses.dataclass(frozen=True)
class Case:
    """One command: `python -m experiments.run ARGS --out_dir=...`."""

    name: str
    args: tuple[str, ...]
    check: Callable[[Path, "object"], None]  # (out_dir, CompletedProcess)
    out_dir: Optional[str] = None  # None: a fresh folder of the test's


def _summary(out_dir: Path) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def _finished(num_requests: int, **figures) -> Callable[[Path, object], None]:
    """The run exits 0 and every request finished; `figures`: summary values, each a
    predicate on the value."""
    def check(out_dir: Path, result) -> None:
        assert result.returncode == 0, result.stderr[-3000:]
        summary = _summary(out_dir)
        assert summary["num_finished"] == num_requests, summary
        for name, holds in figures.items():
            assert holds(summary[name]), (name, summary[name])
    return check


def _error_lines(stderr: str) -> list[str]:
    """stderr's lines but the noise a library may print (jax's log setup, absl's info)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("WARNING: All log messages before",
                                                       "E0000", "W0000", "I0000", "I1"))]


def _refused(status: int, says: str) -> Callable[[Path, object], None]:
    """The run exits with `status` and one error line matching `says` (a regex), and
    leaves no results: no folder, or one marked failed without a summary."""
    def check(out_dir: Path, result) -> None:
        lines = _error_lines(result.stderr)
        assert result.returncode == status, result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert len(lines) == 1 and re.match(says, lines[0]), lines
        if out_dir.exists():
            names = {p.name for p in out_dir.iterdir()}
            assert "summary.json" not in names, names
            assert json.loads((out_dir / "status.json").read_text())["status"] == "failed"
    return check


def _check_speculating_steps(out_dir: Path, result, num_requests: int) -> None:
    _finished(num_requests, num_preemptions=lambda n: n == 0)(out_dir, result)
    summary = _summary(out_dir)
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    requests = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    assert all(sum(row["request_tokens"]) == row["num_tokens"] for row in steps)
    drafted = summary["speculation.drafted_tokens"]
    accepted = summary["speculation.accepted_tokens"]
    assert 0 < accepted < drafted
    # Positions: every prompt token, one a decode step, and every draft verified; the
    # decode steps are the tokens after the first that were not accepted drafts.
    positions = sum(r["prompt_len"] + r["output_len"] - 1 for r in requests) - accepted + drafted
    assert sum(row["num_tokens"] for row in steps) == positions


BAD_CACHE = "tests/plugins/bad_cache_policies.py"


def _cases() -> list[Case]:
    rebalanced = ("--num_requests=20", "--num_replicas=2", "--rebalancer=load_balance")
    tiered = ("--policy=vllm", "--workload=shared_prefix", "--num_requests=40",
              "--prefix_len=fixed:128", "--suffix_len=uniform:16:64",
              "--output_len=uniform:16:64", "--num_kv_pages=40", "--kv_host_pages=8",
              "--prefix_caching=on")
    return [
        # 1: a rebalancer with prefix caching on (it moves a request that shares cached
        # pages: the settings after the command make it move one).
        Case("migration_with_prefix_caching",
             (*SIM, "--policy=sjf", "--workload=shared_prefix", *rebalanced,
              "--prefix_caching=on", "--bucket_ladder=pow2", "--rebalancer_opts=gap=0",
              "--rebalance_interval_s=0.05", "--rate=20", "--max_num_seqs=2"),
             _finished(20, num_migrations=lambda n: n >= 1, prefix_hit_rate=lambda r: r > 0.3)),
        # 2: the default ladder's pilot runs `vllm` (which caches) under the run's rebalancer.
        Case("default_ladder_pilot_with_a_rebalancer",
             (*SIM, "--policy=sjf", "--workload=shared_prefix", *rebalanced),
             _finished(20)),
        # 3: `static` after a migration planned the member that left its batch.
        Case("static_after_a_migration",
             (*SIM, "--policy=static", *rebalanced, "--rebalancer_opts=gap=0",
              "--rebalance_interval_s=0.05", "--rate=20", "--max_num_seqs=2",
              "--bucket_ladder=pow2"),
             _finished(20, num_migrations=lambda n: n >= 1)),
        # 4: a cache policy whose victim() names a page its tier does not hold, or None:
        # one line naming the plugin (under the default ladder, from the pilot).
        *[Case(f"cache_policy_victim_{plugin}_{ladder or 'default'}",
               (*SIM, *tiered, f"--kv_cache_policy={BAD_CACHE}:{plugin}",
                *((f"--bucket_ladder={ladder}",) if ladder else ())),
               _refused(1, f"error: cache policy '{BAD_CACHE}:{plugin}' broke rule "
                           f"'victim_not_held': victim\\(\\) returned {returned}, which the "
                           "host tier does not hold"))
          for plugin, returned in (("NamesAStranger", "'no-such-page'"),
                                   ("NamesNothing", "None"))
          for ladder in ("pow2", None)],
        # 6: plas with one seat: a long prompt preempted in its prefill fell back to the
        # top level and was admitted over the call that preempted it, again and again.
        Case("plas_one_seat_long_prompts",
             (*SIM, "--policy=plas", "--max_num_seqs=1", "--max_num_tokens=64",
              "--num_requests=19", "--prompt_len=fixed:3000", "--num_kv_pages=250",
              "--bucket_ladder=pow2"),
             _finished(19, num_preemptions=lambda n: 0 < n <= 19)),
        # 11: a speculating run's steps.jsonl: request_tokens counts positions as num_tokens.
        Case("speculating_step_rows",
             (*SIM, "--policy=vllm", "--spec_k=4", "--log_step_requests", "--num_requests=12",
              "--prefix_caching=off", "--bucket_ladder=pow2"),
             lambda out_dir, result: _check_speculating_steps(out_dir, result, 12)),
        # 7: a folder where nothing can be created (root's os.access says yes to /proc).
        *([Case("out_dir_in_proc", (*SIM, "--num_requests=5"),
                _refused(2, "error: --out_dir /proc/orca_out: cannot create files in /proc: "),
                out_dir="/proc/orca_out")] if os.path.isdir("/proc/self") else []),
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from forked_cli import run_forked

    cases = _cases()
    outs = tmp_path_factory.mktemp("outs")
    folders = [Path(case.out_dir) if case.out_dir else outs / case.name for case in cases]
    results = run_forked([("experiments.run", (*case.args, f"--out_dir={folder}"))
                          for case, folder in zip(cases, folders)],
                         tmp_path_factory.mktemp("streams"),
                         dict(os.environ, JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore"))
    return {case.name: (case, folder, result)
            for case, folder, result in zip(cases, folders, results)}


@pytest.mark.parametrize("name", [case.name for case in _cases()])
def test_the_soak_reproducer_finishes_or_refuses_in_one_line(outcomes, name):
    case, out_dir, result = outcomes[name]
    case.check(out_dir, result)
