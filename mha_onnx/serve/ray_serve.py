"""``mha-onnx serve --replicas N``: N replicas of the server behind Ray Serve's HTTP proxy, on
a local Ray cluster started here (``pip install 'mha-onnx[ray]'``).

Each replica is the same FastAPI app as ``mha-onnx serve`` (app.py) over its own engine, so
the routes, refusals and metrics are the same; Ray's proxy spreads requests over the
replicas, and every answer names the process that served it (``x-mha-onnx-server``). A
replica that dies loses only the requests it was running (Ray Serve starts another). The
cores are shared out: each replica's ONNX Runtime gets ``cores // N`` threads unless
``--threads`` says otherwise.

    from mha_onnx.serve.ray_serve import application
    serve.run(application("model.onnx", ServeConfig(), replicas=2), route_prefix="/")
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

from mha_onnx.errors import ConfigError
from mha_onnx.serve.service import ServeConfig

log = logging.getLogger(__name__)
NAME = "mha-onnx"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--replicas needs Ray Serve, which is not installed",
                          hint="pip install 'mha-onnx[ray]'") from None
    return ray, serve


def application(model: str, config: ServeConfig, replicas: int):
    """The Ray Serve application: ``replicas`` copies of the server (module doc)."""
    _, serve = _ray()
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    if config.engine.threads is None:
        threads = max(1, (os.cpu_count() or 1) // replicas)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                        threads=threads))
    path = str(model)

    def build():
        from mha_onnx.serve.app import create_app
        from mha_onnx.serve.service import Service

        return create_app(Service(path, config))

    replica = serve.ingress(build)()
    deployment = serve.deployment(replica, name=NAME, num_replicas=replicas,
                                  ray_actor_options={"num_cpus": 0},
                                  max_ongoing_requests=max(8, 2 * (config.engine.max_batch
                                                                   + config.engine.max_queue)),
                                  graceful_shutdown_timeout_s=config.grace)
    return deployment.bind()


def run_replicas(model: str, config: ServeConfig, host: str, port: int, replicas: int,
                 on_ready=None) -> int:
    """Starts a local Ray cluster, serves ``replicas`` replicas on ``host:port`` until SIGTERM
    or SIGINT, then shuts Serve and Ray down; the exit code."""
    ray, serve = _ray()
    app = application(model, config, replicas)
    if port == 0:  # (Ray's proxy takes a port number: a free one)
        import socket

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=NAME, route_prefix="/")
        if on_ready is not None:
            on_ready(port)
        stop.wait()
        log.warning("shutting down %d replica(s)", replicas)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
