"""``mha-onnx serve``'s process: the app on uvicorn, bound where asked (127.0.0.1 by default),
and a graceful shutdown: at SIGTERM or SIGINT the server stops admitting (``/ready`` and new
requests answer 503), lets the running requests finish for ``grace`` seconds, ends what is
left, then closes its connections and exits 0; a second signal exits at once."""

from __future__ import annotations

import logging
import threading

from mha_onnx.serve.service import Service

log = logging.getLogger(__name__)


def run_server(service: Service, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning", on_ready=None) -> int:
    """Serves until a signal (module doc); the exit code. ``on_ready(port)``: called once
    the socket listens (``port`` 0 picks a free one)."""
    import uvicorn

    from mha_onnx.serve.app import create_app

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:  # (uvicorn's, without re-raising the signal)
            if self.draining:
                self.should_exit = self.force_exit = True
                return
            self.draining = True
            log.warning("signal %s: draining (at most %.0f s), then exiting", sig,
                        service.config.grace)
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self) -> None:
            clean = service.drain(service.config.grace)
            if not clean:
                log.warning("the grace period ended: the requests left were ended")
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_ready is not None and self.servers:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = Server(config)
    try:
        server.run()
    finally:
        service.close()
    return 0 if server.started else 1
