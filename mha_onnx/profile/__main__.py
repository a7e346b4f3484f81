"""The measuring child process: ``python -m mha_onnx.profile`` reads one request (a point
spec or a roofline request) as JSON on stdin and prints its result as JSON."""

from __future__ import annotations

import json
import sys

from mha_onnx.errors import MhaOnnxError


def main() -> None:
    request = json.loads(sys.stdin.read())
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
