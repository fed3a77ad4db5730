"""The HTTP server's life: its port taken before the engine compiles, a stop that drains.

`bind_listener` binds the server's socket first thing, so a busy port or a host
that does not resolve is one line before minutes of compiling (the socket is
handed to uvicorn, so nothing can take the port in between; it listens only once
the engine is ready, so until then a client is refused, not left hanging).

`DrainingServer` is uvicorn's server with a graceful stop in two halves. The
first SIGTERM (or Ctrl-C) makes the `LiveRun` refuse new requests, which are
answered 503 (and /health says `draining`), while the requests it holds run to
their end; once none is held, uvicorn's own shutdown closes the listener and the
connections. A second signal stops at once, as uvicorn's does. uvicorn would
raise the signal again once it has shut down, killing the process before the
command's `with` blocks end (the results folder's lock file was left behind): the
signals are kept in `signals` instead, for the command to end as it sees fit.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Optional

import uvicorn

from orca_jax.serving.live import LiveRun


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (not listening yet), for `DrainingServer.run`.

    Raises:
      ValueError: one line naming `--host` (it does not resolve) or `--port` (in use,
        or not allowed), before anything else is built.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host={host}: cannot resolve it ({getattr(e, 'strerror', e)})"
                         ) from None
    listener = socket.socket(family, kind, proto)
    # As uvicorn binds: a port in TIME_WAIT from the last server may be taken at once; one
    # that another socket listens on may not.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as e:
        listener.close()
        raise ValueError(f"--port={port}: cannot listen on {host}:{port}: "
                         f"{e.strerror or e}") from None
    return listener


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first stop signal drains `live` first (module docstring).

    Args:
      config: uvicorn's.
      live: the run whose requests are drained before the server shuts down.
    """

    def __init__(self, config: uvicorn.Config, live: LiveRun) -> None:
        super().__init__(config)
        self.live = live
        self.signals: list[int] = []  # the stop signals received, in order

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """The first signal starts the drain; a second one stops now (SIGINT twice: without
        waiting for the connections either, as uvicorn's)."""
        self.signals.append(sig)
        if not self.live.draining:
            self.live.refuse_new()
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); True ends the main loop: once a drain has no
        request left to finish."""
        if await super().on_tick(counter):
            return True
        return self.live.draining and self.signals != [] and self.live.num_outstanding == 0
