"""A command's process ends without collecting its objects one by one.

When the interpreter exits it runs a last cyclic garbage collection over every
object the process still holds; after a jax run that is the model, its KV cache,
the compiled steps and JAX's and Flax's own objects: about 0.5 s of a 7 s
README main job on a 2-core CPU, spent freeing memory the OS takes back at once.
Likewise every collection during the run (the automatic ones of the oldest
generation, and `run_policy`'s after the scheduler is freed) would walk all the
objects the imports made, which live as long as the process: they are frozen
before `main` starts.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Iterator, Sequence


@contextlib.contextmanager
def imports_uncollected(*, freeze: bool = False) -> Iterator[None]:
    """No garbage collection while a command's imports run (a `with` block around them).

    The imports make hundreds of thousands of objects (modules, classes, functions, flag
    definitions) and almost no garbage, yet each 700 of them started a collection, and
    every tenth of those a pass over all the older ones: about 65 collections, a sixth
    of the CPU of `import experiments.run`. Collection is off inside the block and as it
    was after it, so a test that imports an entry point goes on as before.

    Args:
      freeze: a command's `__main__` only: what the imports made is frozen out of every
        later collection when the block ends (as `without_final_collection` does before
        `main`), instead of the first collection after the block walking all of it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def without_final_collection(main: Callable[[Sequence[str]], Any]
                             ) -> Callable[[Sequence[str]], Any]:
    """`main`, with what the process holds when it starts (the imports, the flags)
    frozen out of its collections, then `gc.freeze()` once it has returned: the exit's
    collection then skips everything `main` left behind.

    Only for a command's `__main__` (`app.run(without_final_collection(main), ...)`):
    in a process that goes on (a test calling `main`), frozen cycles would never be
    freed. A `main` that raises leaves nothing frozen, so an error path loses nothing.
    Every results file is closed by then (the run folders close their streams), so
    nothing waits on a finalizer.
    """
    @functools.wraps(main)
    def run(argv: Sequence[str]) -> Any:
        gc.freeze()  # the modules and what they made: never garbage in this process
        try:
            result = main(argv)
        except BaseException:
            gc.unfreeze()  # as before it started: the error path frees what it can
            raise
        gc.freeze()
        return result
    return run
