"""Before ONNX Runtime touches a model in our own process: create a session and run it once in
a child process, so that a crash inside ORT (a segmentation fault at session creation, say)
becomes a message instead of a dead CLI. When the default optimisation level crashes, the
lower ones are tried and the first that runs is reported: what still works.

``python -m mha_onnx.graph.preflight`` is the child: one JSON request on stdin, one line of JSON out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mha_onnx.runtime.ort import LEVELS  # noqa: F401 (also where callers look for it)


@dataclass(frozen=True)
class Preflight:
    """What happened: ``level`` is the first level (from ``start`` down) at which a session
    was created and ran; ``crashes`` the (level, signal) that killed the child before it."""

    provider: str
    level: str | None
    crashes: tuple[tuple[str, str], ...] = ()
    error: str = ""  # an ordinary failure (ORT refused the model); nothing crashed

    @property
    def crashed(self) -> bool:
        return bool(self.crashes)

    def message(self) -> str:
        """One line: the signal, provider and level, and what still works."""
        if not self.crashes:
            return self.error
        level, sig = self.crashes[0]
        head = (f"onnxruntime crashed ({sig}) creating or running a {self.provider.upper()} "
                f"session for this model at {LEVELS[level]}")
        if self.level is None:
            return head + "; it crashed at every optimisation level"
        return head + f"; it runs at {LEVELS[self.level]}"


def preflight(model: str | os.PathLike[str] | bytes, provider: str = "cpu",
              start: str = "all", *, prepacking: bool = True) -> Preflight:
    """Session + one run of ``model`` in a child process, from level ``start`` down.
    ``prepacking=False``: the session packs no copy of each MatMul weight (fuse's checks:
    the graph's optimisations are what crash at a level; validate's check packs, as users'
    sessions do)."""
    if isinstance(model, bytes):
        with tempfile.TemporaryDirectory(prefix="mha_onnx_preflight_") as folder:
            path = Path(folder) / "model.onnx"
            path.write_bytes(model)
            return preflight(path, provider, start, prepacking=prepacking)
    names = list(LEVELS)
    crashes: list[tuple[str, str]] = []
    for level in names[names.index(start):]:
        outcome = _child({"model": str(model), "provider": provider, "level": level,
                          "prepacking": prepacking})
        if "signal" in outcome:
            crashes.append((level, outcome["signal"]))
            continue
        if "error" in outcome and not crashes:
            return Preflight(provider, None, error=outcome["error"])
        return Preflight(provider, level, tuple(crashes))
    return Preflight(provider, None, tuple(crashes))


def _child(request: dict) -> dict:
    """The request run in a child: forked from a server process that imported what a check
    needs once (a CPU check, where the platform forks: 0.02 s, where a fresh interpreter took
    0.3 s per check), else a fresh ``python -m mha_onnx.graph.preflight``."""
    context = _forkserver() if request["provider"] == "cpu" else None
    if context is None:
        return _interpreter(request)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_forked, args=(request, send), daemon=True)
    process.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:  # (it died before it answered)
        outcome = None
    process.join()
    if process.exitcode is not None and process.exitcode < 0:
        return {"signal": signal.Signals(-process.exitcode).name}
    return outcome or {"error": f"the check ended with exit code {process.exitcode}"}


_CONTEXT: list = []  # the forkserver context, made once (None where it cannot be)


def _forkserver():
    if not _CONTEXT:
        import multiprocessing

        try:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["mha_onnx.graph.preflight", "numpy", "onnx",
                                            "onnxruntime", "mha_onnx.graph.inputs",
                                            "mha_onnx.runtime.ort"])
        except ValueError:
            context = None
        _CONTEXT.append(context)
    return _CONTEXT[0]


def _forked(request: dict, send) -> None:
    """The child's side (forked): ORT's own messages silenced, the outcome sent."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        outcome = _check(request)
    except Exception as exc:  # noqa: BLE001 - any failure is the check's answer
        outcome = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    send.send(outcome)
    send.close()


def _interpreter(request: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "mha_onnx.graph.preflight"],
                          input=json.dumps(request), capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode < 0:
        return {"signal": signal.Signals(-done.returncode).name}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["the check failed"])[-1]
        return {"error": tail[:300]}
    return json.loads(lines[-1])


def _check(request: dict) -> dict:
    """A session of the requested model and one run: {"ok": True}, or {"error": why}."""
    from mha_onnx.errors import MhaOnnxError
    from mha_onnx.graph.cache import is_shared, row_layout, shared_view, takes_length, to_shared
    from mha_onnx.graph.files import read_model
    from mha_onnx.graph.inputs import case_for, make_inputs
    from mha_onnx.runtime.ort import OrtRunner

    try:
        model = read_model(request["model"], load_external_data=False)
        specs, pairs = shared_view(model)  # a shared cache: appended feeds put in buffers
        feeds = make_inputs(specs, case_for(specs, "preflight", 2, [7, 5]))
        if is_shared(model):
            feeds = to_shared(feeds, specs, pairs, rows=row_layout(model),
                              length_input=takes_length(model))
        with OrtRunner(request["model"], request["provider"], optimization=request["level"],
                       strict=False, prepacking=request.get("prepacking", True)) as runner:
            runner.infer(feeds)
    except MhaOnnxError as exc:
        return {"error": str(exc)}
    return {"ok": True}


def _main() -> None:
    print(json.dumps(_check(json.loads(sys.stdin.read()))))


if __name__ == "__main__":
    _main()
