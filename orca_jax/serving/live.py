"""A scheduler serving requests as they come: an open workload on the wall clock.

The scheduler's request table is fixed when it is built, so a `LiveRun` builds it
over `capacity` placeholder rows that no replica holds (`Scheduler(...,
submitted_only=True)`), and fills one row per arriving request, in arrival order
(`RequestTable.fill`), before handing it to the scheduler (`Scheduler.submit`). The
row's index is the request's id in the results folder.

One background thread owns the scheduler: it alone steps it, fills rows, submits,
cancels and stops. Every other thread talks to it through `submit`, `cancel` and
`stop`, which queue a command the thread applies between two iterations, so the
scheduler itself needs no lock. The clock is the wall clock since `start()`: each
iteration starts at the later of the scheduler's clock and the wall clock, and an
arrival is stamped with the wall clock when the thread takes it in.

Tokens are handed back as they reach the host (`Scheduler.generated_tokens`): with
overlap, one step after they were sampled. Each request's events go to the callback
its submission gave, on the engine thread (the callback must not block):
`("tokens", [ids])`, then `("done", reason)` (`length`: its max_tokens; `stop`:
stopped; `cancelled`) or `("error", message)` (rejected: by the policy, or too
large for the KV pool).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from orca_jax.core.api.policy import Policy
from orca_jax.core.loop.config import SchedulerConfig
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine
from orca_jax.core.step.packing import SamplingArrays

# A placeholder row's arrival: later than any real one, so the arrival column stays sorted
# (the scheduler takes arrivals in by a binary search of it).
PLACEHOLDER_ARRIVAL_S = 1e18
Callback = Callable[[tuple[str, Any]], None]


class QueueFull(Exception):
    """The server holds as many requests as it may: answer 429."""


class Unavailable(Exception):
    """The server takes no more requests (draining, or every row used): answer 503."""


@dataclasses.dataclass(frozen=True)
class Submission:
    """One request as a client asked for it."""

    prompt_tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    on_event: Callback
    # The request's own sampling seed (uint32); None: one drawn from the run's seed and
    # the request's row, as an offline run's request gets.
    seed: Optional[int] = None


@dataclasses.dataclass
class _Active:
    on_event: Callback
    arrival_wall: float
    delivered: int = 0
    last_wall: Optional[float] = None
    stopped: bool = False  # ended by `stop` (a stop string), not at its max_tokens


class LiveRun:
    """A scheduler over an open workload, stepped by a background thread.

    Args:
      policy, engine, config: as `Scheduler`'s (the engine warmed up by `start`).
      capacity: rows of the request table: requests served over the server's life.
      max_outstanding: requests held at once (running, waiting or queued); one more is
        refused (`QueueFull`), so memory stays bounded under any load.
      metrics: an observer with `iteration(live)`, `first_token(seconds)`,
        `tokens(count, gap_s)` and `request_done()`, called on the engine thread.
    """

    def __init__(self, policy: Policy, engine: Engine, config: SchedulerConfig, *,
                 capacity: int, max_outstanding: int, metrics: Any = None) -> None:
        placeholders = [Request(id=i, arrival_s=PLACEHOLDER_ARRIVAL_S, prompt_len=1,
                                output_len=1, prompt_tokens=np.zeros(1, np.int32))
                        for i in range(capacity)]
        self.scheduler = Scheduler(placeholders, policy, engine, config, submitted_only=True,
                                   log_tokens=False)
        self.scheduler.awaits_submissions = True  # idle with nothing to do: wait for more
        sampling = config.sampling
        # Per request (a client's temperature and top_p), where a run has one value for all.
        self.scheduler.sampling = SamplingArrays(
            temperature=np.full(capacity, sampling.temperature, np.float32),
            top_k=np.full(capacity, sampling.top_k, np.int32),
            top_p=np.full(capacity, sampling.top_p, np.float32),
            rng_seeds=self.scheduler.sampling.rng_seeds)
        self.capacity = capacity
        self.max_outstanding = max_outstanding
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._next_row = 0  # rows filled so far (under the lock)
        self._outstanding = 0  # submitted and not yet done (under the lock)
        self._accepting = True
        self._active: dict[int, _Active] = {}  # engine thread only
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0
        self.error: Optional[BaseException] = None  # what ended the engine thread

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        """Compiles the engine's steps, starts the clock and the engine thread."""
        scheduler = self.scheduler
        scheduler.engine.warmup(scheduler.bucket_config.buckets())
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="orca-engine", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds on the server's clock (since `start`)."""
        return time.monotonic() - self._t0

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    @property
    def draining(self) -> bool:
        """Whether new requests are refused (`refuse_new` or `drain` was called)."""
        return not self._accepting

    def refuse_new(self) -> None:
        """From now on `submit` raises `Unavailable`; the requests held run on (the first
        half of a graceful stop: the server answers 503 while they finish)."""
        with self._lock:
            self._accepting = False

    @property
    def num_rows(self) -> int:
        """Rows filled: requests taken since the start."""
        return self._next_row

    def submit(self, submission: Submission) -> int:
        """Queues a request; returns its row (its id in the results).

        Raises:
          QueueFull: `max_outstanding` requests are held already.
          Unavailable: draining, every row is used, or the engine thread has failed.
        """
        with self._lock:
            if not self._accepting or self.error is not None:
                raise Unavailable("the server is shutting down (draining the requests it "
                                  "holds)" if self.error is None
                                  else f"the engine failed: {self.error}")
            if self._next_row >= self.capacity:
                raise Unavailable(f"the server has served its {self.capacity} requests "
                                  "(--max_requests); restart it for more")
            if self._outstanding >= self.max_outstanding:
                raise QueueFull(f"the server holds {self._outstanding} requests, its most "
                                "(--max_queued plus --max_num_seqs); retry later")
            row = self._next_row
            self._next_row += 1
            self._outstanding += 1
        self._commands.put(("submit", row, submission))
        return row

    def cancel(self, row: int) -> None:
        """Ends `row`'s request: its client is gone (pages freed, the policy told)."""
        self._commands.put(("cancel", row, None))

    def stop(self, row: int) -> None:
        """Ends `row`'s request with the tokens it has (a stop string was met)."""
        self._commands.put(("stop", row, None))

    def drain(self, timeout_s: Optional[float] = None) -> bool:
        """Refuses new requests, waits until every one held is done, stops the engine
        thread. Returns False if `timeout_s` passed first (the thread is stopped anyway)."""
        self.refuse_new()
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self._outstanding and self.error is None and (
                end is None or time.monotonic() < end):
            time.sleep(0.01)
        drained = self._outstanding == 0
        self._commands.put(("exit", -1, None))
        if self._thread is not None:
            self._thread.join()
        return drained

    def result(self) -> RunResult:
        """The run over the rows filled (after `drain`): a finished run's value."""
        return head(self.scheduler.result(), self._next_row)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                idle = not self._has_work() and not scheduler.executor.num_in_flight
                if not self._apply(block=idle):
                    return
                if self._has_work():
                    scheduler.now_s = max(scheduler.now_s, self.now())
                    scheduler.step()
                elif scheduler.executor.num_in_flight:
                    scheduler.executor.drain()  # the last tokens of requests just done
                self._deliver()
                if self.metrics is not None:
                    self.metrics.iteration(self)
        except BaseException as error:  # noqa: BLE001  (every client must hear of it)
            self.error = error
            for row, active in list(self._active.items()):
                active.on_event(("error", f"the engine failed: {error}"))
                self._done(row)
            raise

    def _has_work(self) -> bool:
        scheduler = self.scheduler
        return bool(scheduler.running.size or scheduler.waiting.size
                    or scheduler.unreleased.size or scheduler.next_arrival_s() is not None)

    def _apply(self, *, block: bool) -> bool:
        """Applies the queued commands (waiting for one if `block`). False: exit."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, row, submission = command
            if kind == "exit":
                return False
            if kind == "submit":
                self._take(row, submission)
            elif kind == "cancel":
                self.scheduler.cancel([row], "cancelled: the client disconnected")
            elif kind == "stop":
                if row in self._active:
                    self._active[row].stopped = True
                self.scheduler.stop([row])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _take(self, row: int, submission: Submission) -> None:
        scheduler = self.scheduler
        now = max(scheduler.now_s, self.now())
        prompt = np.asarray(submission.prompt_tokens, np.int32)
        scheduler.table.fill(row, Request(id=row, arrival_s=now, prompt_len=prompt.size,
                                          output_len=submission.max_tokens,
                                          prompt_tokens=prompt))
        sampling = scheduler.sampling
        sampling.temperature[row] = submission.temperature
        sampling.top_p[row] = submission.top_p
        if submission.seed is not None:
            # Keys are (seed, position) on the device: the same seed, the same draws.
            sampling.rng_seeds[row] = submission.seed
        scheduler.submit([row])
        self._active[row] = _Active(submission.on_event, arrival_wall=self.now())

    def _deliver(self) -> None:
        """Hands each active request its tokens that reached the host, and its end."""
        scheduler = self.scheduler
        table = scheduler.table
        now = self.now()
        for row, active in list(self._active.items()):
            tokens = scheduler.generated_tokens(row)
            if len(tokens) > active.delivered:
                new = tokens[active.delivered:]
                active.delivered = len(tokens)
                if self.metrics is not None:
                    if active.last_wall is None:
                        self.metrics.first_token(now - active.arrival_wall)
                        if len(new) > 1:
                            self.metrics.tokens(len(new) - 1, 0.0)
                    else:
                        self.metrics.tokens(len(new), (now - active.last_wall) / len(new))
                active.last_wall = now
                active.on_event(("tokens", list(new)))
            state = int(table.state[row])
            if state == RequestState.REJECTED:
                reason = table.reject_reason.get(row, "rejected")
                active.on_event(("done", "cancelled") if reason.startswith("cancelled")
                                else ("error", reason))
                self._done(row)
            elif state == RequestState.FINISHED and active.delivered >= table.num_generated[row]:
                active.on_event(("done", "stop" if active.stopped else "length"))
                self._done(row)

    def _done(self, row: int) -> None:
        del self._active[row]
        if self.metrics is not None:
            self.metrics.request_done()
        with self._lock:
            self._outstanding -= 1


def head(result: RunResult, n: int) -> RunResult:
    """`result` over its first `n` requests (the rows a server filled; the placeholders
    after them never ran)."""
    per_request = ("tenant", "priority", "arrival_s", "prompt_len", "output_len", "state",
                   "first_scheduled_s", "first_token_s", "last_token_s", "finish_s",
                   "num_generated", "num_preemptions", "num_cached_tokens", "replica")
    cut: dict[str, Any] = {name: getattr(result, name)[:n] for name in per_request}
    stats = result.token_stats
    cut["token_stats"] = dataclasses.replace(
        stats, num_tokens=stats.num_tokens[:n], last_token_s=stats.last_token_s[:n],
        max_gap_s=stats.max_gap_s[:n])
    cut["request_ids"] = result.request_ids[:n]
    cut["reject_reason"] = result.reject_reason[:n]
    if result.output_tokens is not None:
        cut["output_tokens"] = result.output_tokens[:n]
    return dataclasses.replace(result, **cut)
