"""The measuring child process: ``python -m mha_onnx.profile`` reads one request (a point
spec, a grid of them or a roofline request) as JSON on stdin and prints its result as JSON
(a grid: one line per point as it ends)."""

from __future__ import annotations

import json
import sys

from mha_onnx.errors import MhaOnnxError


def main() -> None:
    request = json.loads(sys.stdin.read())
    if "points" in request:  # a grid: one line per point as it ends
        from mha_onnx.profile.worker import PointSpec, measure_grid

        specs = [PointSpec(**{**data, "models": tuple(data["models"])})
                 for data in request["points"]]
        for n, result in enumerate(measure_grid(specs)):
            print(json.dumps({"index": n, "result": result}), flush=True)
        return
    try:
        if request.get("roofline"):
            from mha_onnx.profile.roofline import matmul_roofline

            out = {"gflops": matmul_roofline(request["provider"], request["threads"],
                                             request["dtype"])}
        elif request.get("bandwidth"):
            from mha_onnx.profile.roofline import memory_bandwidth

            out = {"gbps": memory_bandwidth(request["provider"], request["threads"])}
        else:
            from mha_onnx.profile.worker import PointSpec, measure

            data = dict(request["point"])
            data["models"] = tuple(data["models"])
            out = measure(PointSpec(**data))
    except MhaOnnxError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
