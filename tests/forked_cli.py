"""Many short command-line runs, each its own process, without paying the imports each time.

`run_forked` starts one Python process (this file as a script) that imports what the
entry points import (the framework, jax) once and then forks one child per command: the
child runs `python -m MODULE ARGS` as the interpreter would (`runpy` as `__main__`, its
stdout and stderr to files, its exit status from `SystemExit` or an uncaught exception's
traceback), so each command still exits, prints and leaves its folder as a process of its
own. Only the imports are shared: they have no state a run could change (nothing is
parsed or started before the fork, and jax's backend is not touched). For the tests that
run tens of bad commands, each of which fails in well under a second once imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]


def run_forked(commands: Sequence[tuple[str, Sequence[str]]], scratch: Path,
               env: Mapping[str, str], parallel: int = 2,
               timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Each `(module, args)` run as `python -m module *args` in the repository root with
    `env`, `parallel` at a time; their CompletedProcess (args, returncode, stdout,
    stderr), in order. `scratch` holds their output files."""
    scratch.mkdir(parents=True, exist_ok=True)
    jobs = [{"module": module, "args": list(args), "stdout": str(scratch / f"{i}.out"),
             "stderr": str(scratch / f"{i}.err")} for i, (module, args) in enumerate(commands)]
    server = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(parallel)],
                            input=json.dumps(jobs), cwd=REPO, env=dict(env),
                            capture_output=True, text=True, timeout=timeout)
    if server.returncode != 0:
        raise AssertionError(f"forked_cli server failed: {server.stderr[-3000:]}")
    codes = json.loads(server.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(
        [sys.executable, "-m", job["module"], *job["args"]], code,
        Path(job["stdout"]).read_text(), Path(job["stderr"]).read_text())
        for job, code in zip(jobs, codes)]


def _child(job: dict) -> None:
    """Runs one job in this (forked) process and exits with its status."""
    import atexit
    import runpy
    import traceback

    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [job["module"], *job["args"]]  # runpy puts the module's file first
    code = 0
    try:
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    except SystemExit as done:  # as the interpreter reads it
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught error: its traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs on its way out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(parallel: int) -> None:
    jobs = json.loads(sys.stdin.read())
    # What every entry point imports, once (importing starts nothing: no thread, no backend).
    import jax  # noqa: F401
    from flax import nnx  # noqa: F401

    import experiments.flags  # noqa: F401
    import orca_jax  # noqa: F401
    import policies  # noqa: F401

    sys.stdout.flush()
    sys.stderr.flush()
    codes: list[int] = [0] * len(jobs)
    running: dict[int, int] = {}  # pid -> job index
    for index, job in enumerate(jobs):
        while len(running) >= parallel:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        pid = os.fork()
        if pid == 0:
            try:
                _child(job)
            finally:  # never back into this loop
                os._exit(70)
        running[pid] = index
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(codes))


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it (the repository root), not tests/
    _serve(int(sys.argv[1]))
