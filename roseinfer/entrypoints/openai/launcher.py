"""Run the app under uvicorn, and stop it without cutting anyone off (vLLM's entrypoints/launcher.py).

    Ctrl-C / SIGTERM          drain: stop accepting connections, answer new requests 503 (/health too, so a
                              load balancer moves on), let every request in flight finish
    --shutdown-timeout later  end what is still running: each open stream gets an error event,
      or a second Ctrl-C        data: {"error": {"message": "the server is shutting down ...", "code": 503, ...}}
                              then data: [DONE]; a request still waiting for its first token gets a 503
    a third Ctrl-C            uvicorn's force exit

A stream cut mid-way looks like a network failure to a client, which may retry it blindly; an error event says
what happened. The process exits with status 0 once everything is answered.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

from roseinfer.entrypoints.openai.api_server import begin_drain, end_streams

logger = logging.getLogger("roseinfer.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the two-stage shutdown above."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self.app, self.shutdown_timeout = app, shutdown_timeout
        self.num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """Runs in the signal handler: hand the work to the event loop. (Not recording the signal, as uvicorn
        does to raise it again at exit, lets a clean shutdown exit with 0.)"""
        self.num_signals += 1
        if self.num_signals == 1:
            self.should_exit = True  # uvicorn stops accepting and waits for the open connections
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._drain)
        elif self.num_signals == 2 and self._loop is not None:
            self._loop.call_soon_threadsafe(end_streams, self.app, "a second interrupt")
        else:
            self.force_exit = True

    def _drain(self) -> None:
        logger.warning("draining: finishing the requests in flight (at most %s s)", self.shutdown_timeout)
        begin_drain(self.app)
        self._loop.call_later(self.shutdown_timeout, end_streams, self.app,
                              f"--shutdown-timeout {self.shutdown_timeout:g} s passed")  # fmt: skip


def serve_http(app: FastAPI, host: str, port: int, shutdown_timeout: float = 30.0, log_level: str = "warning") -> None:
    """Serve until a signal; uvicorn's own limit (timeout_graceful_shutdown) backs ours up by a few seconds."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 10)  # fmt: skip
    DrainingServer(config, app, shutdown_timeout).run()
