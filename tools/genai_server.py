"""ONNX Runtime GenAI behind a minimal OpenAI-style streaming ``/v1/completions``, as the anchor
of tools/bench_serve.py (run in GenAI's own environment, `make genai-env`: .venv-genai-rt).
Standard library only besides GenAI and numpy; loopback by default.

    .venv-genai-rt/bin/python tools/genai_server.py GENAI_FOLDER --port 8001 \\
        [--mode generator|engine] [--max-batch 16]

``generator``: one request at a time through ``og.Generator`` (what a user builds on GenAI's
documented loop); ``engine``: GenAI 0.18's ``og.Engine``, which batches requests on the CPU
(its ``engine.static_batching.max_batch_size`` set to ``--max-batch`` in a copy of the
folder's genai_config.json). Prompts are token ids; ``max_tokens`` new tokens, greedy;
``ignore_eos`` (GenAI's min_length / min_generated_tokens) as the load generator sends it.
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


class GeneratorBackend:
    """One request at a time (a lock), each through its own ``og.Generator``."""

    def __init__(self, folder: str, max_batch: int) -> None:
        self.model = og.Model(folder)
        self.lock = threading.Lock()

    def tokens(self, ids: list[int], new: int, ignore_eos: bool):
        with self.lock:
            params = og.GeneratorParams(self.model)
            options = {"max_length": len(ids) + new, "do_sample": False}
            if ignore_eos:
                options["min_length"] = len(ids) + new
            params.set_search_options(**options)
            generator = og.Generator(self.model, params)
            generator.append_tokens(np.array([ids], np.int32))
            while not generator.is_done():
                generator.generate_next_token()
                yield int(generator.get_next_tokens()[0])


class EngineBackend:
    """GenAI's engine: requests added between its runs, events routed to their queues."""

    def __init__(self, folder: str, max_batch: int) -> None:
        copy = Path(tempfile.mkdtemp(prefix="genai_engine_"))
        for path in Path(folder).iterdir():  # (a copy of the config, the rest linked)
            target = copy / path.name
            if path.name == "genai_config.json":
                config = json.loads(path.read_text())
                config["engine"] = {"static_batching": {"max_batch_size": max_batch}}
                target.write_text(json.dumps(config))
            else:
                target.symlink_to(path.resolve())
        self.incoming: queue.Queue = queue.Queue()
        self.routes: dict[int, queue.Queue] = {}
        self.requests: dict[int, object] = {}
        self.wake, self.ready = threading.Event(), threading.Event()
        self._cleanup = copy
        threading.Thread(target=self._loop, daemon=True).start()  # (the engine's owner)
        self.ready.wait()

    def _admit(self) -> None:
        while True:
            try:
                ids, new, ignore_eos, out = self.incoming.get_nowait()
            except queue.Empty:
                return
            request = self.engine.create_request()
            options = og.TurnOptions(request)
            options.set_max_generated_tokens(new)
            if ignore_eos:
                options.set_min_generated_tokens(new)
            options.set_do_sample(False)
            request.begin_turn(np.array(ids, np.int32), options)
            self.routes[id(request)] = out
            self.requests[id(request)] = request

    def _loop(self) -> None:
        self.model = og.Model(str(self._cleanup))
        self.engine = og.Engine(self.model)
        buffer = self.engine.create_event_buffer(256)
        self.ready.set()
        while True:
            self._admit()
            if not self.engine.has_pending_requests():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for event in self.engine.run(buffer):
                key = id(event.request)
                out = self.routes.get(key)
                if out is None:
                    continue
                flags = int(event.flags)
                if flags & int(og.EngineEventFlags.TOKEN):
                    out.put(int(event.token))
                if flags & (int(og.EngineEventFlags.TURN_FINISHED)
                            | int(og.EngineEventFlags.FAILED)):
                    out.put(None)
                    self.routes.pop(key, None)
                    self.requests.pop(key).close()

    def tokens(self, ids: list[int], new: int, ignore_eos: bool):
        out: queue.Queue = queue.Queue()
        self.incoming.put((ids, new, ignore_eos, out))
        self.wake.set()
        while (token := out.get()) is not None:
            yield token


def handler(backend):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # (quiet)
            pass

        def do_POST(self) -> None:  # noqa: N802 (the http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for token in backend.tokens(list(body["prompt"]), int(body["max_tokens"]),
                                        bool(body.get("ignore_eos"))):
                self._chunk({"choices": [{"index": 0, "text": "", "token_ids": [token],
                                          "finish_reason": None}]})
            self._chunk({"choices": [{"index": 0, "text": "", "token_ids": [],
                                      "finish_reason": "length"}]})
            self._send(b"data: [DONE]\n\n")
            self._send(b"")

        def _chunk(self, data: dict) -> None:
            self._send(f"data: {json.dumps(data)}\n\n".encode())

        def _send(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--mode", choices=("generator", "engine"), default="generator")
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args(argv)
    backend = (EngineBackend if args.mode == "engine" else GeneratorBackend)(args.folder,
                                                                           args.max_batch)
    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # (http.server's 5 refused clients past the fifth waiting)
        daemon_threads = True

    server = Server((args.host, args.port), handler(backend))
    print(f"serving {args.folder} ({args.mode}) on http://{args.host}:{server.server_port}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    if isinstance(backend, EngineBackend):
        shutil.rmtree(backend._cleanup, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
