"""A command's default results folder: a fresh one per command, `runs/latest` a link to it.

`run`, `compare` and `serve` used to write into `runs/latest` when no `--out_dir`
was given, so each one silently replaced the last one's results. Without
`--out_dir` each now writes a folder of its own, `runs/<command>-<YYYYmmdd-HHMMSS>`
(`-2`, `-3`, ... when that name is taken), and once its results are written,
`runs/latest` becomes a symbolic link to it (relative, so `runs/` may move; the old
link is replaced atomically, so a reader sees the older results or the newer,
never none). A `runs/latest` that is a real folder (an older version's results) is
left as it is, with a line saying so. A folder named by `--out_dir` is the user's
choice: a run into it replaces it whole, as before (`run_folder`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, os.PathLike]

DEFAULT_OUT_DIR = "runs/latest"  # the flag's default: a fresh folder, this a link to it


def fresh_out_dir(command: str, runs: PathLike = "runs", now: Optional[float] = None) -> Path:
    """A results folder of `runs` that no run holds or writes yet, named by `command` and
    the local time `now` (None: now); created by the command once its checks pass."""
    base = Path(runs) / f"{command}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    candidate, k = base, 2
    # A name is taken by a folder, or by a run still writing it (its lock beside it).
    while os.path.lexists(candidate) or os.path.lexists(f"{candidate}.lock"):
        candidate, k = base.with_name(f"{base.name}-{k}"), k + 1
    return candidate


def point_latest(folder: PathLike, link: PathLike = DEFAULT_OUT_DIR) -> Optional[str]:
    """Makes `link` a symbolic link to `folder` (which exists).

    Returns:
      None, or a line to print when `link` is a real folder or file and was left alone.
    """
    link, folder = Path(link), Path(folder)
    if os.path.lexists(link) and not link.is_symlink():
        return (f"{link} is a folder of its own (an older version's results), not a link: left "
                f"as it is; the newest results are in {folder}")
    target = os.path.relpath(folder.absolute(), link.absolute().parent)
    staged = link.with_name(f".{link.name}.{os.getpid()}")
    if os.path.lexists(staged):
        staged.unlink()
    os.symlink(target, staged)
    os.replace(staged, link)  # atomic: the old link or the new one, never none
    return None
