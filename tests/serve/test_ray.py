"""`mha-onnx serve --replicas 2` on a local Ray cluster: the same routes behind Ray Serve's
proxy, requests spread over both replicas, and a replica killed under load loses only its
own requests while the other serves on."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.servers import fused, serving, wait_until

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'mha-onnx[ray]')")
pytestmark = pytest.mark.models


def test_two_replicas_share_the_load_and_a_killed_one_loses_only_its_requests(tmp_path):
    model = fused("llama", "shared", tmp_path / "llama")
    with serving(model.parent, "--replicas", "2", "--max-batch", "1", timeout=240) as s:
        client = httpx.Client(base_url=s.url, timeout=60)
        assert wait_until(lambda: client.get("/v1/models").status_code == 200, timeout=120)
        names = set()
        for n in range(24):
            reply = client.post("/v1/completions", json={"prompt": [5, n + 3],
                                                         "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            names.add(reply.headers["x-mha-onnx-server"])
        assert len(names) == 2, names  # both replicas served
        dead, survivor = sorted(names)
        victim = int(dead.rsplit(":", 1)[1])

        async def load():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as aclient:
                async def one(n):
                    try:
                        reply = await aclient.post("/v1/completions", json={
                            "prompt": [5, n % 90 + 3], "max_tokens": 240, "temperature": 0,
                            "ignore_eos": True})
                        status, who = reply.status_code, reply.headers.get("x-mha-onnx-server")
                    except httpx.HTTPError as exc:
                        status, who = type(exc).__name__, None
                    return status, who, time.monotonic()
                tasks = [asyncio.create_task(one(n)) for n in range(64)]
                await asyncio.sleep(1.0)
                killed = time.monotonic()
                os.kill(victim, signal.SIGKILL)  # a replica dies mid-load
                return await asyncio.gather(*tasks), killed
        outcomes, killed = asyncio.run(load())
        after = [(status, who) for status, who, ended in outcomes if ended > killed + 0.2]
        # every request ended (none hangs); what ended after the kill came from the survivor
        # or failed cleanly (the victim's own: an error status or a closed connection)
        assert after and all(status == 200 and who != dead or status != 200
                             for status, who in after), outcomes
        assert any(who == survivor for status, who in after if status == 200), outcomes
        assert all(status in (200, 500, 502, 503, "RemoteProtocolError", "ReadError")
                   for status, _, _ in outcomes), outcomes
        # and the service goes on (Ray Serve replaces the dead replica)
        assert wait_until(lambda: client.post("/v1/completions", json={
            "prompt": [5, 6], "max_tokens": 2}).status_code == 200, timeout=60)
