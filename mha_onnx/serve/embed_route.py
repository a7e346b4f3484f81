"""``POST /v1/embeddings``: OpenAI's ``input`` (a string, token ids, or a list of either) through
the encoder's dynamic batches (embed.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from mha_onnx.serve import openai


def inputs(body: dict, text) -> list[list[int]]:
    """Token ids of each input."""
    value = body.get("input")
    ids = openai.token_list(value)
    if ids is not None:
        return [ids]
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise openai.BadRequest("input must be a string, token ids, or a non-empty list of "
                                "either")
    out = []
    for n, item in enumerate(values):
        ids = openai.token_list(item)
        if ids is None and isinstance(item, str) and item:
            if text is None:
                raise openai.BadRequest("this model's folder has no tokenizer.json: give the "
                                        "input as token ids")
            ids = text.encode(item)
        if ids is None:
            raise openai.BadRequest(f"input[{n}] is neither a non-empty string nor token ids")
        out.append(ids)
    return out


async def embed(service, body: Any) -> dict[str, Any]:
    if service.embedder is None:
        raise openai.BadRequest(f"{service.name} is a decoder: it serves /v1/completions and "
                                "/v1/chat/completions")
    openai.check_fields(body, "embedding", service.name)
    rows = inputs(body, service.text)
    futures = [service.embedder.submit(ids) for ids in rows]
    vectors = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    tokens = sum(len(r) for r in rows)
    return {"object": "list", "model": service.name,
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "pooling": service.pooling.describe()}
