"""orca, sleeping `delay_s` before each plan: a server's steps slow enough for a client to
act mid-answer (tests/test_serve.py cancels a stream while its request runs)."""

import dataclasses
import time

from policies.orca import Orca


@dataclasses.dataclass(kw_only=True)
class SlowOrca(Orca):
    delay_s: float = 0.01

    def schedule(self, view):
        time.sleep(self.delay_s)
        return super().schedule(view)
