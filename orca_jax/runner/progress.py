"""Progress of long runs on stderr: a tqdm bar on a terminal, log lines elsewhere.

A log file or a pipe gets absl-logging lines (`I1130 15:38:17 ... run orca:
512/1000 requests ...`), at most one every `interval_s`, never a `\\r` frame.
Short runs show nothing: the bar appears, and the first line is logged, only
after `delay_s`.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Optional

from absl import logging

if TYPE_CHECKING:
    from tqdm import tqdm


class Progress:
    """A count toward a total (requests done, sweep points), shown as it moves.

    Args:
      desc: what is counted toward, e.g. `run orca`.
      total: the count at the end.
      unit: the counted thing, e.g. `requests`.
      delay_s: show nothing before this many seconds.
      interval_s: without a terminal, the least time between two log lines.
      initial: the count already done (a resumed sweep's points).
    """

    def __init__(self, desc: str, total: int, unit: str, *, delay_s: float = 3.0,
                 interval_s: float = 5.0, initial: int = 0) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.delay_s, self.interval_s = delay_s, interval_s
        self.count = initial
        self.start = time.perf_counter()
        self._last_logged: Optional[float] = None
        self._bar: Optional[tqdm] = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # here: a bar needs a terminal, and tqdm costs ~50 ms to import

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=f" {unit}",
                             file=sys.stderr, delay=delay_s, mininterval=0.5, leave=True,
                             dynamic_ncols=True)

    def update(self, count: int, note: str = "") -> None:
        """Sets the count to `count`; `note` says what is going on (steps run, the point)."""
        self.count = count
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(count - self._bar.n)
            return
        now = time.perf_counter()
        if now - self.start < self.delay_s:
            return
        if self._last_logged is None or now - self._last_logged >= self.interval_s:
            self._log(note)
            self._last_logged = now

    def close(self, note: str = "") -> None:
        """Ends the bar; without a terminal, logs the last count if any line was logged."""
        if self._bar is not None:
            self._bar.close()
        elif self._last_logged is not None:
            self._log(note)

    def _log(self, note: str) -> None:
        elapsed = time.perf_counter() - self.start
        logging.info("%s: %d/%d %s, %.0f s%s", self.desc, self.count, self.total, self.unit,
                     elapsed, f", {note}" if note else "")
