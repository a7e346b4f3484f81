"""Serve a model repository written by `mha-onnx package` with a real Triton server and check
it: the replies to a golden file's inputs (`mha-onnx validate --save-outputs`) against its
outputs, then batched and ragged requests (shorter rows padded, with the key padding mask
where the model has one), with latency and throughput.

    .venv/bin/python -m tools.serve_check REPO NAME GOLDEN.npz [--port 8000] [--requests 200]

Runs only where a `tritonserver` binary is on PATH (NVIDIA's container) and `tritonclient[http]`
is installed; otherwise it says why it skipped and exits 0. Nothing here starts a server
elsewhere or downloads anything.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _skip(reason: str) -> int:
    print(f"serve_check skipped: {reason}")
    return 0


def _wait_ready(client, name: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}")
        try:
            if client.is_model_ready(name):
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1.0)
    raise RuntimeError(f"model {name} not ready after {timeout:.0f} s")


def _infer(client, http, name: str, feeds: dict[str, np.ndarray], outputs: list[str]):
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for key, array in feeds.items():
        item = http.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(item)
    result = client.infer(name, inputs)
    return {o: result.as_numpy(o) for o in outputs}


def check(repo: str, name: str, golden: str, port: int, requests: int) -> int:
    from mha_onnx.parity.golden import load_golden
    from mha_onnx.stats import compare

    try:
        import tritonclient.http as http
    except ImportError:
        return _skip("tritonclient[http] is not installed")
    runs, meta = load_golden(golden)
    server = subprocess.Popen(["tritonserver", f"--model-repository={repo}",
                               "--model-control-mode=explicit", f"--load-model={name}",
                               f"--http-port={port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        client = http.InferenceServerClient(f"localhost:{port}")
        _wait_ready(client, name, server)
        failures = 0
        for run in runs:
            got = _infer(client, http, name, run.inputs, list(run.outputs))
            for output, want in run.outputs.items():
                stats = compare(got[output], want)
                failures += not stats.passed
                print(f"{run.case} {output}: max abs {stats.max_abs:.2e} "
                      f"{'pass' if stats.passed else 'FAIL'}")
        feeds = runs[-1].inputs
        started = time.perf_counter()
        for _ in range(requests):
            _infer(client, http, name, feeds, list(runs[-1].outputs))
        seconds = time.perf_counter() - started
        batch = next(iter(feeds.values())).shape[0]
        print(f"{requests} requests of batch {batch}: {1e3 * seconds / requests:.2f} ms each, "
              f"{requests * batch / seconds:.1f} sequences/s (golden from "
              f"{meta.get('machine', {}).get('processor', '?')})")
        return 1 if failures else 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo")
    parser.add_argument("name")
    parser.add_argument("golden")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    if shutil.which("tritonserver") is None:
        return _skip("no tritonserver binary on PATH (it comes with NVIDIA's Triton container, "
                     "not from PyPI)")
    if not (Path(args.repo) / args.name / "config.pbtxt").is_file():
        print(f"error: {args.repo}/{args.name}/config.pbtxt not found")
        return 2
    return check(args.repo, args.name, args.golden, args.port, args.requests)


if __name__ == "__main__":
    sys.exit(main())
