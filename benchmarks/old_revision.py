"""Run a measurement against an old git revision of this repository, beside the current tree.

Shared by the benchmarks that take `--old_rev REV` (`engine_step.py`,
`scheduler_overhead.py`, `sim_speed.py`, `mechanism_unchanged.py`):

- `revision_tree(rev)`: REV's files (`git archive`, so the repository's worktrees and
  index are never touched) in a temporary folder, removed afterwards;
- `tree_env(tree)`: the environment for a child process that must import that tree's
  `orca_jax`, `policies` and `experiments` (the tree alone on PYTHONPATH, so an editable
  install of another checkout cannot shadow it), with bytecode cached per tree, as an
  installed tree has it: where `PYTHONDONTWRITEBYTECODE` is set (this workplace sets it),
  every child would compile every source file again, and a tree with more modules would
  pay that at each start (about 0.1 s a process here) in a figure meant for the loop;
- `interleaved(measure, trees, rounds)`: `measure(tree)` for each tree in turn, round
  after round, every other round in reverse (old, new, new, old, old, new, ...), so a
  busy neighbour slows both sides alike, and load that grows or fades through the run
  does not favour the tree measured first;
- `median_ratio(new, old)`: the new/old ratio of the medians, the figure each script
  prints (beside the geometric mean of those ratios over all its rows).
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

REPO = Path(__file__).resolve().parents[1]
Measured = TypeVar("Measured")


def resolve(rev: str) -> str:
    """The short commit id of `rev`; exits with one line if it names no commit here."""
    result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--short",
                             f"{rev}^{{commit}}"], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"--old_rev {rev}: not a commit of {REPO}")
    return result.stdout.strip()


@contextlib.contextmanager
def revision_tree(rev: str, paths: Sequence[str] = ()) -> Iterator[Path]:
    """Yields a temporary folder holding revision `rev`'s files (only `paths`, if given).

    Args:
      rev: a git revision of this repository (commit, tag, branch).
      paths: top-level paths to extract; all of the revision's files when empty.

    Yields:
      The folder, deleted when the block ends.
    """
    commit = resolve(rev)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *paths],
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix=f"orca_jax_{commit}_") as folder:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            # The "data" filter refuses links and paths out of the folder (Python >= 3.12).
            tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                      else {}))
        yield Path(folder)


def tree_env(tree: Path, **extra: str) -> dict[str, str]:
    """This process's environment with `tree` alone on PYTHONPATH, plus `extra`, and the
    tree's bytecode kept in a cache folder of its own (outside the tree), filled before
    it is returned by a child that imports the commands, so no child compiles them."""
    cache = Path(tempfile.gettempdir()) / "orca_jax_bench_pycache" / (
        str(tree.resolve()).strip("/").replace("/", "_"))
    env = {key: value for key, value in os.environ.items()
           if key != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(cache), **extra)
    if not cache.exists():  # one child fills it: the tree's modules and what they import
        subprocess.run([sys.executable, "-c", "import experiments.run, policies"], cwd=tree,
                       env=env, capture_output=True, check=False)
    return env


def interleaved(measure: Callable[[Path], Measured], trees: dict[str, Path],
                rounds: int) -> dict[str, list[Measured]]:
    """Runs `measure(tree)` for every tree, `rounds` times over, alternating the order.

    Args:
      measure: one measurement of one tree (its result is kept as is).
      trees: label -> tree root, in the order the even rounds visit them (odd rounds
        visit them in reverse).
      rounds: how many times each tree is measured.

    Returns:
      label -> the `rounds` results, in the order they were taken.
    """
    results: dict[str, list[Measured]] = {label: [] for label in trees}
    for round_index in range(rounds):
        order = list(trees.items())
        for label, tree in order[::-1] if round_index % 2 else order:
            results[label].append(measure(tree))
    return results


def median_ratio(new: Sequence[float], old: Sequence[float]) -> float:
    """median(new) / median(old): below 1 means the new tree takes less."""
    return statistics.median(new) / statistics.median(old)
