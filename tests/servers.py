"""Helpers of the serving tests: decoder folders made from the committed Optimum fixtures
(fused, with a small tokenizer trained here), `mha-onnx serve` as a real process on a free
loopback port, and each request's tokens generated alone by `mha-onnx generate`'s library."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.paths import OPTIMUM

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def tokenizer(folder: Path, vocab: int = 128, template: str | None = TEMPLATE) -> None:
    """A BPE tokenizer of at most ``vocab`` tokens (``<unk>``, ``<s>``, ``</s>`` first), trained
    on a few sentences, written into ``folder`` with its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ["the quick brown fox jumps over the lazy dog", "attention is all you need",
            "multi head attention from pytorch to production under onnx runtime"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab, limit_alphabet=30, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def fused(family: str, form: str, out: Path, weights: str | None = None) -> Path:
    """The Optimum fixture ``family`` fused with ``form`` (and quantized to ``weights``) into
    ``out``/model.onnx."""
    from mha_onnx.rewrite import fuse_file
    from mha_onnx.rewrite.policy import FormPolicy

    path = out / "model.onnx"
    out.mkdir(parents=True, exist_ok=True)
    fuse_file(OPTIMUM / family / "model.onnx", path, policy=FormPolicy(kv_cache=form))
    if weights:
        from mha_onnx.quantize.run import quantize_file
        from mha_onnx.quantize.weights import QuantizeConfig

        quantized = out / weights / "model.onnx"
        quantized.parent.mkdir()
        quantize_file(path, quantized, QuantizeConfig(weights=weights), sensitivity=False,
                      check=False, force=True)
        return quantized
    return path


def alone(model: Path, prompts: list[list[int]], news: list[int]) -> list[list[int]]:
    """Each prompt generated alone (batch 1) by `generate`'s library, greedy."""
    from mha_onnx.generate import GenerationConfig, Generator

    with Generator(model) as generator:
        return [list(generator.generate([p], GenerationConfig(n)).sequences[0])
                for p, n in zip(prompts, news, strict=True)]


def served(model: Path, prompts: list[list[int]], news: list[int], max_batch: int = 4,
           chunk: int = 5) -> list[list[int]]:
    """Each prompt submitted to one continuously batched engine while the others run (their
    prompts in chunks of ``chunk``), greedy: the tokens of each."""
    from mha_onnx.serve import Engine, EngineConfig, Request

    with Engine(model, EngineConfig(max_batch=max_batch, prefill_chunk=chunk)) as engine:
        handles = []
        for prompt, new in zip(prompts, news, strict=True):
            handles.append(engine.submit(Request(tuple(prompt), new)))
            time.sleep(0.003)
        return [list(h.result(120).tokens) for h in handles]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    stderr: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.stderr[-40:])


@contextmanager
def serving(*args: str, timeout: float = 120.0) -> Iterator[Server]:
    """`mha-onnx serve ARGS --port 0` in a process of its own, ready; stopped at the end."""
    process = subprocess.Popen([sys.executable, "-m", "mha_onnx.cli", "serve", *map(str, args),
                                "--host", "127.0.0.1", "--port", "0"],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if "serving " in line and " on http://" in line:
                found.append(line.rsplit(" on ", 1)[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    server = Server(found[0] if found else "", process, lines)
    try:
        assert found, f"the server did not start: {''.join(lines)[-3000:]}"
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_until(check, timeout: float = 10.0, every: float = 0.05) -> bool:
    """Polls ``check()`` until true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return bool(check())


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus' text."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
