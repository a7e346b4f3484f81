"""A load generator for OpenAI-compatible completion servers: streaming clients, prompts and
outputs of mixed lengths, bounded in count and time, loopback by default.

    .venv/bin/python -m tools.loadgen http://127.0.0.1:8000 --concurrency 16 --requests 200 \\
        [--prompt 32:1024] [--output 16:256] [--time-limit 600] [--vocab 512] [--seed 0] \\
        [--style ours|llama-cpp] [--tokenizer DIR] [--json OUT.json]

Request ``i`` is the same for every server and concurrency (its prompt length, output length
and token ids drawn from ``--seed`` and ``i``; with ``--tokenizer``, ids of whole words, whose
text any server's tokenizer reads back as the same ids: llama-cpp-python's server takes text
only): ``--concurrency`` clients each take the next
request until ``--requests`` are sent or ``--time-limit`` seconds have passed (then no new
request starts, and the running ones get ``--time-limit`` more at most). Each request
streams; every event that carries a token counts one token and its arrival time. Outputs run
to ``max_tokens`` (EOS ignored: ``ignore_eos`` for ours, an EOS logit bias for
llama-cpp-python's server), so every server does the same work.

Reported: aggregate output tokens/s (all requests' tokens over the run's wall time), time to
first token and inter-token latency (p50/p99, over all requests' gaps), request latency, and
errors by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Outcome:
    """One request as the client saw it (seconds from the run's start)."""

    index: int
    prompt: int
    wanted: int
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    done: float = 0.0
    error: str | None = None


def request_shape(index: int, seed: int, prompt: tuple[int, int], output: tuple[int, int],
                  vocab: int, words: list[int] | None = None) -> tuple[list[int], int]:
    """Request ``index``'s prompt ids and output length (the same for every server); with
    ``words``, ids drawn from them only."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(prompt[0], prompt[1] + 1))
    new = int(rng.integers(output[0], output[1] + 1))
    if words:
        return [int(words[i]) for i in rng.integers(0, len(words), size=n)], new
    return [int(t) for t in rng.integers(3, vocab, size=n)], new


def whole_words(folder: str) -> dict[int, str]:
    """The whole words of a tokenizer.json that begin with a space (byte-level BPE's "Ġ"), by
    id: any sequence of them reads back as the same ids, whatever server tokenizes its text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    words = {}
    for token, i in tokenizer.get_vocab().items():
        text = token.replace("\u0120", " ")
        if len(text) > 2 and text[0] == " " and text[1:].isalpha() and \
                tokenizer.encode(text + text, add_special_tokens=False).ids == [i, i]:
            words[i] = text
    return dict(sorted(words.items()))


def body(ids: list[int], new: int, style: str, eos: int, words: dict | None = None) -> dict:
    prompt = "".join(words[i] for i in ids) if style == "llama-cpp" else ids
    out = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    if style == "ours":
        out["ignore_eos"] = True
    else:  # llama-cpp-python's server: EOS made impossible
        out["logit_bias"] = {str(eos): -1e9}
    return out


async def _one(client, outcome: Outcome, payload: dict, start: float, limit: float) -> None:
    outcome.sent = time.perf_counter() - start
    try:
        async with asyncio.timeout(limit):
            async with client.stream("POST", "/v1/completions", json=payload) as response:
                if response.status_code != 200:
                    outcome.error = f"HTTP {response.status_code}"
                    await response.aread()
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.error = "stream error"
                        continue
                    for choice in event.get("choices", []):
                        tokens = len(choice.get("token_ids") or []) or \
                            (1 if choice.get("finish_reason") is None else 0)
                        now = time.perf_counter() - start
                        outcome.arrivals += [now] * tokens
    except TimeoutError:
        outcome.error = "timeout"
    except Exception as exc:  # noqa: BLE001 - the server went away, a reset: counted
        outcome.error = type(exc).__name__
    outcome.done = time.perf_counter() - start


async def run_load(url: str, args) -> list[Outcome]:
    import httpx

    words = whole_words(args.tokenizer) if args.tokenizer else None
    if args.style == "llama-cpp" and not words:
        raise SystemExit("--style llama-cpp sends text: give --tokenizer DIR")
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    next_index = iter(range(args.requests))
    limits = httpx.Limits(max_connections=args.concurrency + 4)

    async def client_loop(client) -> None:
        for index in next_index:
            if time.perf_counter() - start > args.time_limit:
                return
            ids, new = request_shape(index, args.seed, args.prompt, args.output, args.vocab,
                                     list(words) if words else None)
            outcome = Outcome(index, len(ids), new)
            outcomes.append(outcome)
            await _one(client, outcome, body(ids, new, args.style, args.eos, words), start,
                       args.time_limit)

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    return outcomes


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summary(outcomes: list[Outcome]) -> dict:
    """The figures of a run (module doc); latencies in ms."""
    ok = [o for o in outcomes if o.error is None]
    tokens = sum(len(o.arrivals) for o in outcomes)
    wall = max((o.done for o in outcomes), default=0.0) - min((o.sent for o in outcomes),
                                                              default=0.0)
    ttft = [o.arrivals[0] - o.sent for o in ok if o.arrivals]
    gaps = [b - a for o in ok for a, b in zip(o.arrivals, o.arrivals[1:], strict=False)]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    short = sum(1 for o in ok if len(o.arrivals) != o.wanted)
    return {"requests": len(outcomes), "ok": len(ok), "errors": errors,
            "short_outputs": short, "output_tokens": tokens,
            "prompt_tokens": sum(o.prompt for o in outcomes), "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99),
            "latency_p50_ms": _pct([o.done - o.sent for o in ok], 50),
            "latency_p99_ms": _pct([o.done - o.sent for o in ok], 99)}


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--prompt", type=_span, default=(32, 1024))
    p.add_argument("--output", type=_span, default=(16, 256))
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--eos", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--style", choices=("ours", "llama-cpp"), default="ours")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json: prompts "
                   "of its whole words (ids for ours, their text for llama-cpp)")
    p.add_argument("--json", default=None, help="write the summary and every request here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    outcomes = asyncio.run(run_load(args.url, args))
    result = summary(outcomes)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": result, "requests": [asdict(o) for o in outcomes]}, f)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
