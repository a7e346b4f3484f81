"""One model behind the server: its file found in the folder, what it is (a decoder with a KV
cache, or an encoder for embeddings), its tokenizer, its engine and its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mha_onnx.errors import ConfigError, ModelFileError
from mha_onnx.serve.config import EngineConfig


@dataclass(frozen=True)
class ServeConfig:
    """``name``: the model id clients send (default: the folder's name); ``grace``: seconds a
    shutdown waits for running requests before it ends them; ``window``: seconds an encoder
    waits for more inputs to batch; ``tokenizer``: a folder with tokenizer.json (default: the
    model's folder, then the HF folder it was exported from)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    name: str | None = None
    grace: float = 30.0
    window: float = 0.005
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.grace < 0:
            raise ConfigError(f"--grace must be >= 0 seconds, got {self.grace}")
        if not 0 <= self.window <= 1:
            raise ConfigError(f"--batch-window must be in [0, 1] seconds, got {self.window}")


def model_file(path: str | Path) -> Path:
    """The ONNX file to serve: ``path`` itself, or in a folder its ``model.onnx`` (else its one
    .onnx file that is not GenAI's ``*.genai.onnx``)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ModelFileError(f"{path} does not exist", hint="pass a .onnx file or its folder")
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    found = sorted(p for p in path.glob("*.onnx") if not p.name.endswith(".genai.onnx"))
    if len(found) != 1:
        raise ModelFileError(f"{path} holds {len(found)} .onnx files and no model.onnx",
                             hint="pass the file itself")
    return found[0]


def _folders(path: Path, model) -> list[Path]:
    """Where the tokenizer and configs may lie: beside the file, then the HF folder export
    recorded in ``model`` (the file's structure)."""
    from mha_onnx.graph import metadata

    out = [path.parent]
    hf = metadata.loaded(model, "hf_model") or {}
    if hf.get("folder") and Path(hf["folder"]).is_dir():
        out.append(Path(hf["folder"]))
    return out


def is_decoder(model) -> bool:
    """Is ``model`` (a file's structure) a decoder with a KV cache and logits?"""
    from mha_onnx.graph.cache import cache_pairs

    return bool(cache_pairs(model)) and any(o.name == "logits" for o in model.graph.output)


def _weights(model) -> str:
    """``model``'s weights as `quantize` recorded them: float, int4, int8 or w8a8 (and the
    embedding's form where it is not float)."""
    from mha_onnx.graph import metadata

    record = metadata.loaded(model, "quantization") or {}
    embedding = record.get("embeddings", "float")
    return record.get("weights", "float") + ("" if embedding == "float"
                                             else f" (embedding {embedding})")


class Service:
    """The model served (module doc): ``engine`` for a decoder, ``embedder`` for an encoder."""

    def __init__(self, model: str | Path, config: ServeConfig = ServeConfig()) -> None:
        from mha_onnx.graph.files import read_model
        from mha_onnx.serve.text import load_text

        self.config, self.path = config, model_file(model)
        structure = read_model(self.path, load_external_data=False)  # (read once)
        self.weights = _weights(structure)
        folders = [Path(config.tokenizer)] if config.tokenizer else _folders(self.path,
                                                                              structure)
        self.text = next((t for f in folders if (t := load_text(f)) is not None), None)
        if config.tokenizer and self.text is None:
            raise ModelFileError(f"--tokenizer {config.tokenizer} holds no tokenizer.json")
        source = Path(model)
        self.name = config.name or (source.name if source.is_dir() else self.path.parent.name)
        self.engine = self.embedder = None
        self.notes: tuple[str, ...] = ()
        if is_decoder(structure):
            self.task = "text-generation"
            self._decoder()
        else:
            self.task = "feature-extraction"
            self._encoder(folders)

    def _decoder(self) -> None:
        from mha_onnx.serve.engine import Engine
        from mha_onnx.serve.metrics import Metrics

        cfg = self.config.engine
        self.metrics = Metrics()
        self.engine = engine = Engine(self.path, cfg, observer=self.metrics)
        self.metrics.bind(lambda: engine.queue_depth, lambda: engine.running, engine.rows.slots)
        self.notes = self.engine.notes
        if self.text is not None and not self.engine.eos:
            eos = self.text.token_id("eos_token")  # (the model names none: the tokenizer's)
            if eos is not None and eos < self.engine.interface.vocab:
                self.engine.eos = (eos,)
        self.max_length = self.engine.max_length

    def _encoder(self, folders: list[Path]) -> None:
        from mha_onnx.serve.embed import Embedder, read_pooling
        from mha_onnx.serve.metrics import Metrics

        cfg = self.config.engine
        self.pooling = read_pooling(folders)
        self.metrics = Metrics()
        self.embedder = Embedder(self.path, self.pooling, max_batch=cfg.max_batch,
                                 window=self.config.window, max_queue=max(1, cfg.max_queue),
                                 max_length=cfg.max_length, threads=cfg.threads,
                                 observer=self.metrics)
        embedder = self.embedder
        self.metrics.bind(lambda: embedder.queue_depth, lambda: 0, embedder.max_batch)
        self.max_length = cfg.max_length

    @property
    def alive(self) -> bool:
        return (self.engine or self.embedder).alive

    @property
    def admitting(self) -> bool:
        return (self.engine or self.embedder).admitting

    def drain(self, grace: float | None = None) -> bool:
        return (self.engine or self.embedder).drain(grace)

    def close(self) -> None:
        (self.engine or self.embedder).close(0.0)

    def card(self) -> dict:
        """``GET /v1/models``'s entry."""
        out = {"id": self.name, "object": "model", "owned_by": "mha-onnx",
               "task": self.task, "file": str(self.path), "weights": self.weights,
               "max_model_len": self.max_length,
               "tokenizer": str(self.text.folder) if self.text else None,
               "notes": list(self.notes)}
        if self.engine is not None:
            out |= {"max_batch": self.engine.rows.slots,
                    "cache": self.engine.interface.form,
                    "chat_template": bool(self.text and self.text.template)}
        else:
            out["pooling"] = self.pooling.describe()
        return out

