"""A run's results folder that never describes two runs: staged beside, moved in at the end.

A run writes into a fresh staging folder beside its `--out_dir`
(`<out_dir>.running-<pid>-<id>`), streaming `requests.jsonl` and `steps.jsonl`
as it goes and keeping `status.json` (`running`, then `finished` or `failed`).
When the run ends, finished or failed, the staging folder replaces `--out_dir`
whole; until then `--out_dir` holds the previous run untouched. So:

* a finished run's folder holds only its own files, status `finished`;
* a run that raised (a plugin's error, a plan error, Ctrl-C) leaves its partial
  logs in `--out_dir`, status `failed` with the error, the step and the virtual
  time (Ctrl-C: reason `interrupted`); the previous run's files are gone, so
  none of them can look current;
* a run killed outright (SIGKILL, power loss) leaves `--out_dir` as it was and
  its staging folder beside it, status still `running` with the dead pid, until
  the next run into `--out_dir` finishes and removes it;
* a write that fails (disk full) removes the staging folder: `--out_dir` as it
  was, no `.tmp` left, and a `ResultsWriteError` of one line.

`--out_dir` is checked before the run (`check_out_dir`, which leaves nothing: a probe
file it writes beside the folder is removed at once): not a file, creatable and
writable, and, if it exists, holding nothing but a
run's results files (JSON and JSON Lines files), so a mistyped `--out_dir=.`
cannot replace a folder of other things. One run at a time writes into a
folder: a run holds `OUT_DIR.lock` beside it (`folder_lock.run_lock`, the lock a
sweep holds on its folder), and a second run into it is refused in one line.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from orca_jax.core.json_files import (
    to_json_value,
    write_json_atomic,
    write_jsonl_atomic,
    write_lines_atomic,
)
from orca_jax.results.folder_lock import run_lock

STATUS_FILE = "status.json"
# What a results folder may hold, so replacing it loses nothing else: a run's files
# (config, requests, steps, summary, status, tables beside the summary) are JSON or
# JSON Lines.
RESULT_SUFFIXES = (".json", ".jsonl")
# How often the streamed logs reach the file (a SIGKILL loses at most this much).
FLUSH_EVERY_S = 1.0
# Each streamed log's buffer, in bytes. The streams reach the file every `FLUSH_EVERY_S`
# whatever it holds, so a buffer of a fraction of a second's rows (a run writes a few MB
# a second) loses nothing more to a kill; the default (a block, 4 KiB) is smaller than
# one append (32 step lines, ~10 KB), so every append was a write of its own (a system
# call a few times the cost of copying its lines into this buffer).
STREAM_BUFFER_BYTES = 1 << 20


class OutDirError(ValueError):
    """`--out_dir` cannot hold the run's results (found before the run starts)."""


class ResultsWriteError(RuntimeError):
    """Writing the results failed (e.g. the disk is full); the folder was left as it was."""


def _one_line(error: OSError) -> str:
    return error.strerror or str(error)


def _check_creatable(out_dir: Union[str, os.PathLike], target: Path) -> None:
    """Checks that `target` could be created and written, creating nothing: its nearest
    existing ancestor is a writable folder."""
    ancestor = target.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutDirError(f"--out_dir {out_dir}: cannot create it: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutDirError(f"--out_dir {out_dir}: {ancestor} is not writable")
    _probe_writable(out_dir, ancestor)


def _probe_writable(out_dir: Union[str, os.PathLike], folder: Path) -> None:
    """Creates a file in `folder` and removes it at once: `os.access` answers yes to root
    for any folder, and a read-only or pseudo file system (`/proc`) refuses only the write
    itself, which would come after the run (the lock, the staging folder)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".orca_jax-probe-", dir=folder)
    except OSError as error:
        raise OutDirError(f"--out_dir {out_dir}: cannot create files in {folder}: "
                          f"{_one_line(error)}") from None
    os.close(fd)
    os.unlink(probe)


def check_out_dir(out_dir: Union[str, os.PathLike]) -> Path:
    """Checks that a run's results can go to `out_dir`, before anything runs; leaves nothing
    (a probe file is removed at once; a run that is refused later leaves no folder).

    Args:
      out_dir: the run's folder (created at the end if missing).

    Returns:
      `out_dir` as an absolute path.

    Raises:
      OutDirError: it is a file, it holds something that is not a run's results
        file, or it could not be created or written.
    """
    target = Path(out_dir).absolute()
    if target.exists() and not target.is_dir():
        raise OutDirError(f"--out_dir {out_dir}: is a file, not a folder")
    if target.is_dir():
        foreign = sorted(p.name for p in target.iterdir()
                         if not (p.is_file() and p.suffix in RESULT_SUFFIXES))
        if foreign:
            raise OutDirError(f"--out_dir {out_dir}: holds {', '.join(foreign[:3])}"
                              f"{' ...' if len(foreign) > 3 else ''}, not a run's results; a run "
                              "replaces its folder whole, so choose a new or empty one")
    _check_creatable(out_dir, target)
    return target


def check_writable_dir(out_dir: Union[str, os.PathLike]) -> Path:
    """Checks that `out_dir` (a folder of several runs: a comparison's, a sweep's) can be
    created and written, before anything runs; creates nothing (its command creates it
    once every check has passed).

    Raises:
      OutDirError: it is a file, or could not be created or written.
    """
    target = Path(out_dir).absolute()
    if target.exists() and not target.is_dir():
        raise OutDirError(f"--out_dir {out_dir}: is a file, not a folder")
    if target.is_dir():
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutDirError(f"--out_dir {out_dir}: is not writable")
        _probe_writable(out_dir, target)
    else:
        _check_creatable(out_dir, target)
    return target


class RunFolder:
    """One run's results, staged beside `out_dir` and moved into place at the end.

    Use: `RunFolder(out_dir)` (checks `out_dir`, creates the staging folder,
    status `running`), `begin(config)`, then `append_requests`/`append_steps`
    as the run goes, and one of `finish(...)`, `fail(error, ...)` or
    `discard()`.

    Args:
      out_dir: the run's folder.
      label: the run's name in status.json (the policy).

    Raises:
      OutDirError: as `check_out_dir`, or the staging folder cannot be made.
    """

    def __init__(self, out_dir: Union[str, os.PathLike], label: str = "") -> None:
        self.target = check_out_dir(out_dir)
        self.staging = self.target.with_name(
            f"{self.target.name}.running-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self._status: dict[str, Any] = {
            "status": "running", "label": label, "pid": os.getpid(),
            "host": socket.gethostname(), "started_at": time.time()}
        self._streams: dict[str, IO[str]] = {}
        self._last_flush = time.monotonic()
        # One run at a time into a folder (re-entrant: the command may hold it already).
        self._lock = run_lock(self.target)
        try:
            self._lock.acquire()
        except OSError as e:
            raise OutDirError(f"--out_dir {out_dir}: cannot write beside it in "
                              f"{self.target.parent}: {_one_line(e)}") from None
        try:
            self.staging.mkdir()
        except OSError as e:
            self._lock.release()
            raise OutDirError(f"--out_dir {out_dir}: cannot write beside it in "
                              f"{self.target.parent}: {_one_line(e)}") from None
        self._guard(self._write_status)

    # ------------------------------------------------------------ writing
    def _guard(self, write, *args) -> Any:
        """Runs one write; a failure (disk full) removes the staging folder and says so."""
        try:
            return write(*args)
        except OSError as e:
            self.discard()
            what = "disk full" if e.errno == errno.ENOSPC else _one_line(e)
            raise ResultsWriteError(f"cannot write the results of {self.target}: {what} "
                                    "(the folder is as it was)") from None

    def _write_status(self) -> None:
        self._status["updated_at"] = time.time()
        write_json_atomic(self.staging / STATUS_FILE, self._status, fsync=False)

    def begin(self, config: Mapping[str, Any], *, stream: bool = True) -> None:
        """Writes config.json and, to `stream` the logs, opens them (a run that cannot
        stream writes them whole at the end, `write_rows`)."""
        def start() -> None:
            write_json_atomic(self.staging / "config.json", config)
            for name in ("requests.jsonl", "steps.jsonl") if stream else ():
                self._streams[name] = open(self.staging / name, "w",
                                           buffering=STREAM_BUFFER_BYTES)
        self._guard(start)

    def append_requests(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Appends requests.jsonl rows (finished requests, in the order they finished)."""
        self._guard(self._append, "requests.jsonl", rows)

    def append_steps(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Appends steps.jsonl rows, in step order."""
        self._guard(self._append, "steps.jsonl", rows)

    def append_lines(self, name: str, lines: Iterable[str]) -> None:
        """Appends rows already encoded (one JSON text each, no newline) to the streamed
        `name` (requests.jsonl or steps.jsonl)."""
        self._guard(self._append_lines, name, lines)

    def flush_due(self) -> bool:
        """Whether `FLUSH_EVERY_S` has passed since the streams last reached the file (the
        next append sends them)."""
        return time.monotonic() - self._last_flush >= FLUSH_EVERY_S

    def _append(self, name: str, rows: Iterable[Mapping[str, Any]]) -> None:
        self._append_lines(name, (json.dumps(row) for row in rows))

    def _append_lines(self, name: str, lines: Iterable[str]) -> None:
        stream = self._streams[name]
        text = "\n".join(lines)  # one write of the flush's lines, not one a line
        if text:
            stream.write(text + "\n")
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_EVERY_S:
            self._last_flush = now
            for open_stream in self._streams.values():
                open_stream.flush()

    def _close_streams(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close()

    def write_rows(self, name: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Writes `name` whole (replacing its streamed version) from `rows`, one by one."""
        self._replace_streamed(name, lambda: write_jsonl_atomic(self.staging / name, rows))

    def write_lines(self, name: str, lines: Iterable[str]) -> None:
        """`write_rows` of rows already encoded (one JSON text each, no newline)."""
        self._replace_streamed(name, lambda: write_lines_atomic(self.staging / name, lines))

    def _replace_streamed(self, name: str, write: Callable[[], None]) -> None:
        """Closes `name`'s stream, if any, then `write`s the whole file (guarded)."""
        def replace() -> None:
            stream = self._streams.pop(name, None)
            if stream is not None:
                stream.close()
            write()
        self._guard(replace)

    def rewrite_streamed(self, name: str,
                         lines_of: Callable[[Iterator[str]], Iterable[str]]) -> None:
        """Writes the streamed `name` whole again from its own lines: `lines_of` gets the
        streamed lines (no newline, in file order) and gives the final file's (encoded
        rows, no newline). The streamed file stays whole until the new one replaces it."""
        def rewrite() -> None:
            self._streams.pop(name).close()
            path = self.staging / name
            with open(path) as streamed:
                write_lines_atomic(path, lines_of(line[:-1] for line in streamed))
        self._guard(rewrite)

    def keep_streamed(self, name: str) -> None:
        """Keeps the streamed `name` as the final file (it already holds every row)."""
        def close() -> None:
            stream = self._streams.pop(name)
            stream.flush()
            os.fsync(stream.fileno())
            stream.close()
        self._guard(close)

    def write_json(self, name: str, obj: object) -> None:
        """Writes one JSON file of the run (summary.json, ...)."""
        self._guard(write_json_atomic, self.staging / name, obj)

    # ------------------------------------------------------------ ending
    def finish(self, **facts: Any) -> Path:
        """Marks the run finished (with `facts`, e.g. steps and virtual time) and moves it
        into place. Returns the run's folder."""
        self._guard(self._close_streams)
        self._status.update(status="finished", **to_json_value(facts))
        self._guard(self._write_status)
        try:
            folder = self._guard(self._move_into_place)
            self._remove_stale_siblings()
        finally:
            self._lock.release()
        return folder

    def fail(self, error: BaseException, **facts: Any) -> Path:
        """Marks the run failed with `error` (and `facts`: the step, the virtual time) and
        moves its partial logs into place. Returns the run's folder."""
        if isinstance(error, KeyboardInterrupt):
            message, reason = "interrupted (Ctrl-C)", "interrupted"
        else:
            message = f"{type(error).__name__}: {error}"
            reason = "error"
        where = traceback.extract_tb(error.__traceback__)
        self._status.update(status="failed", reason=reason, error=message,
                            error_at=(f"{where[-1].filename}:{where[-1].lineno}"
                                      if where else None), **to_json_value(facts))
        self._guard(self._close_streams)
        self._guard(self._write_status)
        try:
            return self._guard(self._move_into_place)
        finally:
            self._lock.release()

    def discard(self) -> None:
        """Removes the staging folder (the target stays as it was)."""
        for stream in self._streams.values():
            try:
                stream.close()
            except OSError:
                pass  # a full disk cannot take the buffer; the folder goes anyway
        self._streams = {}
        shutil.rmtree(self.staging, ignore_errors=True)
        self._lock.release()

    def _remove_stale_siblings(self) -> None:
        """Removes what runs killed outright (SIGKILL, power loss) left beside the folder:
        their staging folders (`.running-PID-ID`) and set-aside old folders (`.old-PID-ID`).
        Every run into the folder holds its lock, so while this one does no other writes
        them; one whose writer (PID) is a live process of this host is left all the same."""
        pattern = re.compile(re.escape(self.target.name) + r"\.(running|old)-(\d+)-[0-9a-f]{6}")
        for path in self.target.parent.iterdir():
            match = pattern.fullmatch(path.name)
            if not match or path == self.staging or not path.is_dir():
                continue
            pid = int(match.group(2))
            host = socket.gethostname()
            if match.group(1) == "running":
                try:
                    host = (read_status(path) or {}).get("host", host)
                except (OSError, ValueError):
                    pass  # a status cut short by the kill: the pid decides
            if host == socket.gethostname() and pid != os.getpid() and _alive(pid):
                continue
            shutil.rmtree(path, ignore_errors=True)

    def _move_into_place(self) -> Path:
        # A folder cannot be renamed over a non-empty one: the old one steps aside first,
        # and goes once the new one is in place.
        old = None
        if self.target.exists():
            old = self.target.with_name(f"{self.target.name}.old-{os.getpid()}-"
                                        f"{uuid.uuid4().hex[:6]}")
            os.rename(self.target, old)
        os.rename(self.staging, self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.target


def _alive(pid: int) -> bool:
    """Whether a process of this host has the id `pid`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def read_status(folder: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """A run folder's status.json, or None when it has none (a run written before runs kept one)."""
    path = Path(folder) / STATUS_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())
