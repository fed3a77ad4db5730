"""One writer per results folder: an exclusive `flock` that names its holder.

Every command that writes a results folder holds its lock while it runs: a
sweep (`sweep_store.SweepLock`, `sweep.lock` inside the folder, which a sweep
keeps), a run and a comparison (`run_lock`, `OUT_DIR.lock` beside the folder,
since a run replaces its folder whole; removed when the run ends). A second
writer into a folder in use is refused with one line naming the holder (pid,
host, start time). The kernel drops a flock when its process ends, however it
ends, so a lock file that still names a holder nobody holds is stale: the next
writer takes it over with a line saying so.

The lock is re-entrant within a process: `experiments.run` takes its folder's
lock before it builds the workload, and the `RunFolder` it then opens takes the
same lock again without blocking on itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, os.PathLike]


class FolderLockedError(ValueError):
    """Another live process is writing into the folder."""


def _when(timestamp: object) -> str:
    return (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
            if isinstance(timestamp, (int, float)) else "an unknown time")


class FolderLock:
    """The lock of one results folder (see the module docstring).

    Args:
      folder: the folder it guards (named in messages).
      path: the lock file.
      kind: who takes it: 'sweep', 'run', 'compare' (named in messages and in the file).
      remove_on_release: remove the lock file when released (a run's, beside its folder),
        rather than leave it empty (a sweep's, inside its folder).
    """

    # Lock files this process holds -> [fd, depth] (the lock is re-entrant in a process).
    _held: dict[str, list[int]] = {}
    locked_error: type[FolderLockedError] = FolderLockedError

    def __init__(self, folder: PathLike, path: PathLike, kind: str, *,
                 remove_on_release: bool = False) -> None:
        self.folder, self.path, self.kind = Path(folder), Path(path), kind
        self.remove_on_release = remove_on_release
        self._key = os.path.abspath(self.path)
        self._made: list[Path] = []  # folders acquire created, removed again if left empty
        self._taken = False

    def acquire(self) -> None:
        """Takes the lock, or says who holds it.

        Raises:
          FolderLockedError: another live process holds it (names its pid, host and start
            time).
        """
        if self._taken:
            return
        held = self._held.get(self._key)
        if held is not None:
            held[1] += 1
            self._taken = True
            return
        self._made = _make_parents(self.path.parent)
        fd = self._open_locked()
        stale = self._holder(fd)
        if stale:
            print(f"{self.kind}: taking over the lock of pid {stale.get('pid', '?')} on "
                  f"{stale.get('host', '?')} (started {_when(stale.get('started_at'))}): "
                  "that process is gone", file=sys.stderr)
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started_at": time.time(), "kind": self.kind}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)
        os.fsync(fd)
        self._held[self._key] = [fd, 1]
        self._taken = True

    def _open_locked(self) -> int:
        """An fd of the lock file holding its flock. A file removed by its last holder
        between our open and our flock is not the lock any more: open it again."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                self._remove_made()
                raise self.locked_error(
                    f"{self.folder} is in use by another {holder.get('kind', self.kind)} (pid "
                    f"{holder.get('pid', '?')} on {holder.get('host', '?')}, started "
                    f"{_when(holder.get('started_at'))}); wait for it to end, or choose "
                    "another --out_dir") from None
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                return fd
            os.close(fd)

    def release(self) -> None:
        """Lets the lock go (the outermost release of this process): the file is emptied,
        or removed, so a clean end leaves no holder."""
        if not self._taken:
            return
        self._taken = False
        held = self._held[self._key]
        held[1] -= 1
        if held[1] > 0:
            return
        del self._held[self._key]
        fd = held[0]
        try:
            if self.remove_on_release:
                self.path.unlink(missing_ok=True)  # while held: no one can take it meanwhile
            else:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock
        if self.remove_on_release:
            self._remove_made()

    def _remove_made(self) -> None:
        for folder in reversed(self._made):
            try:
                folder.rmdir()  # only if empty: what the run wrote stays
            except OSError:
                break
        self._made = []

    @staticmethod
    def _holder(fd: int) -> dict[str, Any]:
        """The holder the lock file names ({} when it names none, or cannot be read)."""
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _make_parents(folder: Path) -> list[Path]:
    """Creates `folder` and its missing parents; returns those it created, outermost first."""
    missing: list[Path] = []
    current: Optional[Path] = folder
    while current is not None and not current.exists():
        missing.append(current)
        current = current.parent if current.parent != current else None
    folder.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def run_lock(out_dir: PathLike, kind: str = "run") -> FolderLock:
    """The lock of a run's (or a comparison's) folder: `OUT_DIR.lock` beside it, since a run
    replaces its folder whole; removed when the run ends."""
    folder = Path(out_dir).absolute()
    return FolderLock(out_dir, folder.with_name(f"{folder.name}.lock"), kind,
                      remove_on_release=True)
