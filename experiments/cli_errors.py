"""Every error a user can cause as one line and an exit status; a plugin's own as its frames.

`clean_errors` wraps an entry point's `main`; `parse_flags` is its absl flag parser
(`app.run(main, flags_parser=parse_flags)`). Both are re-exported by `experiments.flags`.

  * Bad input (`USAGE_ERRORS`: a flag, a trace, a checkpoint, a policy's spec or
    knobs, an engine setting, an --out_dir that cannot hold results or that another
    run, comparison or sweep is writing, a sweep folder of another configuration or
    with a malformed points.jsonl line):
    `error: ...` naming the culprit, exit status 2.
  * A failed run (`RUN_ERRORS`: a plan that breaks a rule, results that could not be
    written): one line, exit status 1.
  * SIGINT: one line, exit status 130 (128 + the signal, as a shell reports it). The
    interruption is Python's `KeyboardInterrupt` until it reaches the entry point, so
    the run's own code can mark its results interrupted on the way out.
  * An error raised in a plugin's own code: a traceback of the plugin's frames only,
    ending at its line, exit status 1.
  * Anything else is a bug of the framework and keeps its whole traceback.

`run_command` is the entry point's `app.run`: `--help` (and `--helpfull`, `--helpxml`)
exit 0 where absl exits 1 (`--help` is a request the command answered, not an error),
and a closed stdout (`... | head -1`) ends the command quietly with exit status 141,
as a shell reports a command ended by SIGPIPE (`yes | head -1`): the reader stopped
reading, so whatever was still to come, a run's results included, was not done.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import traceback
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

import absl
from absl import app, flags

import orca_jax
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.kv.cache_policies import CachePolicyError
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.step.engine_api import EngineConfigError
from orca_jax.results.folder_lock import FolderLockedError
from orca_jax.results.run_folder import OutDirError, ResultsWriteError
from orca_jax.results.sweep_errors import SweepConfigError, SweepError, SweepPointsError
from orca_jax.workloads.traces import TraceError

USAGE_ERRORS: tuple[type[BaseException], ...] = (
    app.UsageError, flags.Error, PolicyLoadError, TraceError, EngineConfigError, OutDirError,
    FolderLockedError, SweepConfigError, SweepPointsError, SweepError)
# A plan (or a cache policy) that breaks a rule; results that could not be written (a
# full disk).
RUN_ERRORS: tuple[type[BaseException], ...] = (PlanError, CachePolicyError, ResultsWriteError)
USAGE_EXIT, RUN_EXIT, INTERRUPT_EXIT = 2, 1, 130
CLOSED_PIPE_EXIT = 141  # 128 + SIGPIPE, as a shell reports a command the signal ended


def _package_dir(name: str) -> Optional[str]:
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.realpath(locations[0]) if locations else None


_FRAMEWORK_DIRS = tuple(
    os.path.join(path, "") for path in {
        os.path.realpath(os.path.dirname(orca_jax.__file__)),
        os.path.realpath(os.path.dirname(__file__)),  # experiments/
        _package_dir("policies"),
    } if path)


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[str, ...]:
    """Frames under these are the framework's or a library's; a frame anywhere else is a
    plugin's. Asked for when an error is reshaped, not at import: the installation's paths
    load its build configuration (`sysconfig`), which a run without an error never needs."""
    import sysconfig  # lazy: the module too is only for a run with an error (see above)
    return _FRAMEWORK_DIRS + tuple(
        os.path.join(path, "") for path in {
            os.path.realpath(os.path.dirname(absl.__file__)),
            *(os.path.realpath(p) for key, p in sysconfig.get_paths().items()
              if key in ("stdlib", "platstdlib", "purelib", "platlib")),
        })


def _is_plugin_file(filename: str) -> bool:
    """Whether a traceback frame's file is a plugin's: a real file outside the framework,
    the built-in policies, the standard library and installed packages."""
    if not os.path.isfile(filename):  # <string> (a dataclass's __init__), <frozen ...>
        return False
    return not os.path.realpath(filename).startswith(_library_dirs())


def plugin_traceback(error: BaseException) -> Optional[str]:
    """The traceback of an error raised in a plugin's own code, cut to the plugin's frames.

    The error is the plugin's when a plugin frame is on the stack and nothing of the
    framework runs below its last one (what it called of the standard library or numpy
    may); the traceback then ends at the plugin's line. Otherwise None: an error raised
    inside the framework keeps its whole traceback, a plugin above it or not.
    """
    frames = traceback.extract_tb(error.__traceback__)
    plugin = [i for i, frame in enumerate(frames) if _is_plugin_file(frame.filename)]
    if not plugin or any(os.path.realpath(frame.filename).startswith(_FRAMEWORK_DIRS)
                         for frame in frames[plugin[-1] + 1:]):
        return None
    return "".join(["Traceback (most recent call last; the framework's frames left out):\n",
                    *traceback.format_list([frames[i] for i in plugin]),
                    *traceback.format_exception_only(type(error), error)]).rstrip("\n")


def _exit(message: str, status: int) -> None:
    print(message, file=sys.stderr)
    sys.exit(status)


def one_line(error: BaseException) -> str:
    """`error: ...` on one line (a message of several lines is joined)."""
    text = " ".join(str(error).split("\n")).strip() or type(error).__name__
    return f"error: {text}"


@contextlib.contextmanager
def clean_errors() -> Iterator[None]:
    """Turns the errors a user can cause into one clear line and an exit status (see the
    module docstring).

    A context manager, and so also a decorator of an entry point's `main`.
    """
    try:
        yield
    except USAGE_ERRORS as e:
        _exit(one_line(e), USAGE_EXIT)
    except RUN_ERRORS as e:
        _exit(one_line(e), RUN_EXIT)
    except KeyboardInterrupt:
        _exit("interrupted (SIGINT): stopped before the run finished", INTERRUPT_EXIT)
    except Exception as e:  # noqa: BLE001 -- only a plugin's own error is reshaped here
        trimmed = plugin_traceback(e)
        if trimmed is None:
            raise
        _exit(trimmed, RUN_EXIT)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing with a bad flag as one line and exit status 2 (pass as
    `app.run(main, flags_parser=parse_flags)`)."""
    try:
        return flags.FLAGS(list(argv))
    except flags.Error as e:
        _exit(one_line(e), USAGE_EXIT)
        raise  # not reached: for type checkers
    except SystemExit as e:
        # While flags parse, only absl's help flags exit: with 1 after printing the help
        # that was asked for (--only_check_flags with 0).
        sys.exit(0 if e.code == 1 else e.code)


def not_a_command(module: str, holds: str, instead: str) -> NoReturn:
    """What a helper module run as a command (`python -m MODULE --help`) answers, rather
    than nothing: one line on stderr saying what it holds and which command to run, exit
    status 2 (`USAGE_EXIT`)."""
    _exit(f"error: {module} is not a command: it holds {holds}; run {instead}", USAGE_EXIT)
    raise AssertionError("not reached: _exit exits")


def run_command(main: Callable[[list[str]], Any],
                flags_parser: Callable[[list[str]], Any] = parse_flags) -> NoReturn:
    """`app.run(main, flags_parser=flags_parser)`, ending quietly on a closed stdout.

    A pipe's reader that has stopped (`| head -1`) makes the next write or the last
    flush raise BrokenPipeError; stdout is then pointed at os.devnull, so the
    interpreter's own flush at exit fails no more, and the command exits with
    CLOSED_PIPE_EXIT and no traceback (the recipe of Python's `signal` documentation).
    """
    try:
        try:
            app.run(main, flags_parser=flags_parser)
        finally:
            sys.stdout.flush()  # here, not at exit, where its error cannot be caught
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(CLOSED_PIPE_EXIT)
    raise AssertionError("app.run returned")  # not reached: it always exits
