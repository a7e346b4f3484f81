"""`mha-onnx serve` as a real process on a loopback port: concurrent streaming clients get the
tokens `generate` gives each request alone; OpenAI's shapes (text, chat, streams, usage, stop
strings); refusals that are one line each while the server serves on; a full queue answered
429, never 500; clients that leave mid-stream free their rows; SIGTERM under load exits 0
within the grace period; and an encoder's embeddings, batched under concurrency, equal the
original's."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import numpy as np
import pytest

from tests.servers import alone, fused, metric, serving, tokenizer, wait_until

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The Optimum Llama fused with a shared cache, a tokenizer and a chat template beside it."""
    model = fused("llama", "shared", tmp_path_factory.mktemp("served") / "llama")
    tokenizer(model.parent)
    return model


@pytest.fixture(scope="module")
def server(llama):
    with serving(llama.parent, "--max-batch", "4", "--max-queue", "8", "--name", "llama") as s:
        yield s


async def _stream(client, url: str, body: dict, stop_after: int | None = None) -> dict:
    """One streamed request: its token ids, text, finish reason, usage and errors."""
    out = {"ids": [], "text": "", "finish": None, "usage": None, "error": None, "events": 0}
    async with client.stream("POST", url, json=body | {"stream": True}) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            out["retry_after"] = float(response.headers.get("Retry-After", 0))
            out["error"] = json.loads(await response.aread())["error"]["message"]
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
                continue
            out["events"] += 1
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event["choices"]:
                out["ids"] += choice["token_ids"]
                out["text"] += choice.get("text") or choice.get("delta", {}).get("content") or ""
                out["finish"] = choice["finish_reason"] or out["finish"]
            if stop_after is not None and out["events"] >= stop_after:
                return out  # (the client leaves: the connection closes)
    return out


def _clients(url: str, bodies: list[dict], stagger: float = 0.01, retries: int = 0,
             **kw) -> list[dict]:
    """Each body streamed by its own client, ``stagger`` seconds apart; ``retries``: a
    client answered 429 (the queue full: a slow machine) asks again after its Retry-After,
    up to that many times, as a well-behaved client does."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def one(n, body):
                await asyncio.sleep(n * stagger)
                route = body.pop("_route", "/v1/completions")
                for _ in range(retries):
                    out = await _stream(client, route, body, **kw)
                    if out["status"] != 429:
                        return out
                    await asyncio.sleep(out["retry_after"])
                return await _stream(client, route, body, **kw)
            return await asyncio.gather(*(one(n, dict(b)) for n, b in enumerate(bodies)))
    return asyncio.run(main())


def test_sixteen_streaming_clients_get_the_tokens_each_gets_alone(llama, server):
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 120, size=int(s))]
               for s in rng.integers(2, 60, size=16)]
    news = [int(x) for x in rng.integers(4, 48, size=16)]
    want = alone(llama, prompts, news)
    got = _clients(server.url, [{"prompt": p, "max_tokens": n, "temperature": 0,
                                 "stream_options": {"include_usage": True}}
                                for p, n in zip(prompts, news, strict=True)], retries=20)
    assert [g["ids"] for g in got] == want, ([g["error"] for g in got], server.log())
    for g, w, p in zip(got, want, prompts, strict=True):
        assert g["finish"] == ("stop" if w[-1] == 2 else "length")
        assert g["usage"] == {"prompt_tokens": len(p), "completion_tokens": len(w),
                              "total_tokens": len(p) + len(w)}


def test_text_chat_and_stop_strings(llama, server):
    client = httpx.Client(base_url=server.url, timeout=60)
    models = client.get("/v1/models").json()["data"][0]
    assert (models["id"], models["task"], models["cache"]) == ("llama", "text-generation",
                                                              "shared")
    assert models["weights"] == "float"
    text = client.post("/v1/completions", json={"model": "llama", "prompt": "the quick fox",
                                                "max_tokens": 12, "temperature": 0}).json()
    ids = text["choices"][0]["token_ids"]
    from mha_onnx.serve.text import load_text

    tok = load_text(llama.parent)
    assert ids == alone(llama, [tok.encode("the quick fox")], [12])[0]
    assert text["choices"][0]["text"] == tok.decode(ids)
    # a stop string: the text ends before it, finish "stop"
    full = text["choices"][0]["text"]
    cut = next((k for k in range(3, len(full)) if full[k - 2:k].strip() == full[k - 2:k]), None)
    if cut:
        stop = full[cut - 2:cut]
        stopped = client.post("/v1/completions", json={
            "prompt": "the quick fox", "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
        assert stopped["choices"][0]["text"] == full[:full.find(stop)]
        assert stopped["choices"][0]["finish_reason"] == "stop"
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello fox"}], "max_tokens": 6,
        "temperature": 0}).json()
    prompt = tok.chat([{"role": "user", "content": "hello fox"}])
    assert prompt == tok.encode("<s>user: hello fox\nassistant:", special=False)
    assert chat["choices"][0]["token_ids"] == alone(llama, [prompt], [6])[0]
    assert chat["object"] == "chat.completion" and chat["usage"]["prompt_tokens"] == len(prompt)
    streamed = _clients(server.url, [{"_route": "/v1/chat/completions", "max_tokens": 6,
                                      "messages": [{"role": "user", "content": "hello fox"}],
                                      "temperature": 0}])[0]
    assert streamed["ids"] == chat["choices"][0]["token_ids"]
    assert streamed["text"] == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, status, says", [
    ("{not json", 400, "not JSON"),
    ({"model": "gpt-4", "prompt": [1, 2]}, 404, "'gpt-4' is not served here"),
    ({"prompt": [1, 2], "n": 2}, 400, "n=2"),
    ({"prompt": [1, 2], "logprobs": 2, "best_of": 3}, 400, "best_of=3, logprobs=2"),
    ({"prompt": [1, 2], "frequency_penalty": 0.5, "tools": []}, 400, "unknown field(s): tools"),
    ({"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens must be >= 1"),
    ({"prompt": [1, 2] * 200, "max_tokens": 4}, 400, "leave no room in 256 positions"),
    ({"prompt": [1, 2], "max_tokens": 300}, 400, "more than the 256 a row holds"),
    ({"prompt": [1, 2000]}, 400, "outside the vocabulary of 128"),
    ({"prompt": [1, 2], "temperature": 3}, 400, "temperature must be in [0.0, 2.0]"),
    ({"prompt": ""}, 400, "prompt must be"),
    ({"input": "hello"}, 400, "unknown field(s): input"),
], ids=lambda v: v if isinstance(v, int) else None)
def test_a_bad_request_is_one_line_and_the_server_serves_on(server, body, status, says):
    client = httpx.Client(base_url=server.url, timeout=30)
    sent = client.post("/v1/completions", content=body) if isinstance(body, str) else \
        client.post("/v1/completions", json=body)
    assert sent.status_code == status, sent.text
    message = sent.json()["error"]["message"]
    assert says in message and "\n" not in message
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code \
        == 200


def test_chat_without_a_template_is_a_400_and_a_request_past_its_time_a_504(tmp_path):
    model = fused("llama", "appended", tmp_path / "plain")
    tokenizer(model.parent, template=None)
    with serving(model.parent, "--name", "plain", "--request-timeout", "0.000001") as s:
        sent = httpx.post(f"{s.url}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert sent.status_code == 400 and "no chat template" in sent.json()["error"]["message"]
        assert httpx.post(f"{s.url}/v1/embeddings", json={"input": "hi"},
                          timeout=30).status_code == 400
        late = httpx.post(f"{s.url}/v1/completions", json={"prompt": "the fox"}, timeout=30)
        assert late.status_code == 504 and "timeout" in late.json()["error"]["message"]
        streamed = _clients(s.url, [{"prompt": "the fox", "max_tokens": 4}])[0]
        assert streamed["ids"] == [] and "timeout" in streamed["error"]


def test_two_hundred_clients_against_a_queue_of_eight_get_429s_and_no_500(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=200)) as client:
            async def one(n):
                return await client.post("/v1/completions", json={
                    "prompt": [3 + n % 50, 7], "max_tokens": 24, "temperature": 0})
            return await asyncio.gather(*(one(n) for n in range(200)))
    replies = asyncio.run(main())
    statuses = [r.status_code for r in replies]
    assert set(statuses) == {200, 429}, sorted(set(statuses))
    assert all(r.headers.get("retry-after") for r in replies if r.status_code == 429)
    assert statuses.count(200) >= 12  # (4 rows and 8 places at least)


def test_fifty_clients_that_leave_mid_stream_free_their_rows(server):
    got = _clients(server.url, [{"prompt": [5 + n, 9], "max_tokens": 200, "temperature": 0}
                                for n in range(50)], stagger=0.002, stop_after=2)
    assert all(g["status"] in (200, 429) for g in got)
    assert sum(g["status"] == 200 for g in got) >= 12

    def idle() -> bool:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return metric(text, "mha_onnx_running_rows") == 0 and \
            metric(text, "mha_onnx_queue_depth") == 0
    assert wait_until(idle, timeout=30), server.log()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert metric(text, 'mha_onnx_requests_finished_total{reason="cancelled"}') >= 1
    for name in ("mha_onnx_time_to_first_token_seconds_count",
                 "mha_onnx_inter_token_latency_seconds_count", "mha_onnx_tokens_per_second",
                 "mha_onnx_batch_occupancy_count", "mha_onnx_max_batch"):
        metric(text, name)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_sigterm_under_load_exits_0_within_the_grace_period(llama):
    with serving(llama.parent, "--max-batch", "1", "--grace", "2") as s:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                loads = [asyncio.create_task(_stream(client, "/v1/completions", {
                    "prompt": [5, n + 3], "max_tokens": 240, "temperature": 0}))
                    for n in range(40)]  # (one row: more work than the grace period)
                await asyncio.sleep(0.5)
                s.process.send_signal(signal.SIGTERM)
                started = time.monotonic()
                await asyncio.sleep(0.2)
                refused = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
                ready = await client.get("/ready")
                return await asyncio.gather(*loads), refused, ready, started
        got, refused, ready, started = asyncio.run(main())
        code = s.process.wait(15)
        assert code == 0, s.log()
        assert time.monotonic() - started < 2 + 8
        assert refused.status_code == 503 and ready.status_code == 503
        # every stream ended: whole, or told that the server ended it
        assert all(g["finish"] is not None or "shutdown" in (g["error"] or "") for g in got)


def test_an_encoders_embeddings_are_batched_and_equal_the_originals(tmp_path):
    from mha_onnx.runtime.ort import OrtRunner
    from mha_onnx.serve.embed import Pooling
    from mha_onnx.stats import compare
    from tests.paths import OPTIMUM

    model = fused("bert", "appended", tmp_path / "bert")
    rng = np.random.default_rng(0)
    inputs = [[int(t) for t in rng.integers(5, 90, size=int(n))]
              for n in rng.integers(3, 30, size=24)]
    with serving(model.parent, "--max-batch", "8", "--batch-window", "0.02") as s:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/embeddings", json={"input": ids})
                                              for ids in inputs))
        replies = asyncio.run(main())
        metrics = httpx.get(f"{s.url}/metrics").text
    assert all(r.status_code == 200 for r in replies)
    served = np.array([r.json()["data"][0]["embedding"] for r in replies])
    assert replies[0].json()["pooling"] == "mean pooling (default)"
    runs = metric(metrics, "mha_onnx_batch_occupancy_count")
    assert runs < len(inputs)  # batched
    with OrtRunner(str(OPTIMUM / "bert" / "model.onnx"), "cpu") as original:
        want = []
        for ids in inputs:  # each alone, unpadded
            feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)),
                                                                            np.int64),
                     "token_type_ids": np.zeros((1, len(ids)), np.int64)}
            hidden = original.infer(feeds)["last_hidden_state"]
            want.append(Pooling()(hidden.astype(np.float64), feeds["attention_mask"])[0])
    assert compare(served.astype(np.float32), np.array(want, np.float32)).passed
