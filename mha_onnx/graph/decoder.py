"""What a decoder ONNX file asks of a generation loop, read from the file itself.

The contract (the names Optimum's exports, ``export --model`` and ORT GenAI's builder share):

- ``input_ids`` [batch, sequence_length]: the new tokens of this run;
- ``attention_mask`` [batch, past + new] (optional): 1 for every key a row keeps, 0 for its
  padding; grows by one column per step;
- ``position_ids`` [batch, sequence_length] (optional): each kept token's position counted
  over the row's kept tokens (a left-padded row starts at 0 after its padding);
- ``past_key_values.N.key/value`` -> ``present.N.key/value``: the KV cache, appended
  ([batch, kv_heads, past, head] in, past + new out) or shared (``fuse --kv-cache shared``:
  one [batch, kv_heads, max_length, head] buffer that is both, written in place);
- ``logits`` [batch, sequence_length, vocab], or [batch, 1, vocab] for a model written with
  ``--logits last`` (each row's last kept position only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from mha_onnx.errors import ConfigError
from mha_onnx.graph import metadata
from mha_onnx.graph.cache import LENGTH_INPUT, cache_pairs
from mha_onnx.graph.inputs import NP_TYPES, input_specs

IDS, MASK, POSITIONS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"


@dataclass(frozen=True)
class TokenIds:
    """The special tokens a loop needs, and where they were read."""

    eos: tuple[int, ...] = ()
    pad: int | None = None
    bos: int | None = None
    source: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return {"eos_token_id": list(self.eos), "pad_token_id": self.pad,
                "bos_token_id": self.bos, "source": self.source}


@dataclass(frozen=True)
class DecoderInterface:
    """One decoder file's generation interface."""

    pasts: tuple[tuple[str, str], ...]  # (past input, present output) in input order
    kv_heads: int
    head_size: int
    kv_dtype: str  # numpy dtype name of the cache
    vocab: int
    shared: bool  # one buffer per past, written in place
    length_input: bool  # shared: the cached length is an input (else from the mask's shape)
    last_logits: bool  # logits [B, 1, V]: each row's last kept position only
    dtypes: dict[str, str] = field(default_factory=dict)  # ids/mask/positions input dtypes
    position_limit: int | None = None  # rows of a learned position table
    tokens: TokenIds = TokenIds()
    model_type: str | None = None
    context_length: int | None = None
    # a past's own (kv heads, head size), where it is not (kv_heads, head_size): DeepSeek's
    # MLA (V's heads narrower than K's), MiMo-V2-Flash (sliding layers cache more heads)
    past_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def head_of(self, past: str) -> int:
        return self.past_shapes.get(past, (self.kv_heads, self.head_size))[1]

    def kv_heads_of(self, past: str) -> int:
        return self.past_shapes.get(past, (self.kv_heads, self.head_size))[0]

    @property
    def has_mask(self) -> bool:
        return MASK in self.dtypes

    @property
    def has_positions(self) -> bool:
        return POSITIONS in self.dtypes

    @property
    def form(self) -> str:
        return "shared" if self.shared else "appended"

    def to_dict(self) -> dict[str, Any]:
        return {"cache": self.form, "layers": len(self.pasts) // 2, "kv_heads": self.kv_heads,
                "head_size": self.head_size, "kv_dtype": self.kv_dtype, "vocab": self.vocab,
                "logits": "last" if self.last_logits else "all",
                "inputs": sorted(self.dtypes), "position_limit": self.position_limit,
                "tokens": self.tokens.to_dict()}


def read_interface(model: onnx.ModelProto, path: str | Path | None = None) -> DecoderInterface:
    """The interface of ``model`` (a file at ``path``: its folder may hold the HF config
    Optimum writes beside it); a model that is not a decoder with a KV cache is refused."""
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name: o for o in model.graph.output}
    name = Path(path).name if path else "the model"
    if IDS not in inputs:
        what = ("an encoder-decoder's decoder (encoder_hidden_states)"
                if "encoder_hidden_states" in inputs else
                "a model without input_ids" if "inputs_embeds" not in inputs
                else "a decoder fed inputs_embeds")
        raise ConfigError(f"{name} is not a token decoder: {what}",
                          hint="generate runs decoders with input_ids, logits and a KV cache "
                               "(export --model of a ...ForCausalLM folder, or its Optimum "
                               "export)")
    pairs = cache_pairs(model)
    if LOGITS not in outputs or not pairs:
        raise ConfigError(f"{name} is not a decoder with a KV cache (it needs a 'logits' "
                          "output and past_key_values.N.key/value inputs returned as presents)",
                          hint="export it with --task text-generation-with-past")
    known = {IDS, MASK, POSITIONS, LENGTH_INPUT, *pairs}
    extra = [n for n in inputs if n not in known
             and n not in {t.name for t in model.graph.initializer}]
    if extra:
        raise ConfigError(f"{name} takes inputs a generation loop does not feed: "
                          f"{', '.join(extra)}",
                          hint="an Optimum merged decoder (use_cache_branch) is exported "
                               "without --monolith/merging: `optimum-cli export onnx --task "
                               "text-generation-with-past`")
    recorded = metadata.loaded(model, "kv_cache") or {}
    config = hf_config(model, path)
    shared = recorded.get("form") == "shared" or LENGTH_INPUT in inputs \
        or (not recorded and bool(config.get("past_present_share_buffer")))
    past = inputs[next(iter(pairs))]
    dims = past.type.tensor_type.shape.dim
    kv_heads, head = _cache_dims(dims, config, name)
    specs = {s.name: s for s in input_specs(model)}
    logits_dims = outputs[LOGITS].type.tensor_type.shape.dim
    vocab = logits_dims[2].dim_value if len(logits_dims) == 3 and logits_dims[2].dim_value \
        else (config.get("vocab_size") or specs[IDS].bound)
    limit = None
    if POSITIONS in specs and specs[POSITIONS].role == "ids" and specs[POSITIONS].bound > 16:
        limit = specs[POSITIONS].bound  # position_ids index a learned table
    recorded_limit = (metadata.loaded(model, "hf_model") or {}).get("positions")
    if recorded_limit:
        limit = min(limit or recorded_limit, int(recorded_limit))
    dtypes = {n: NP_TYPES[inputs[n].type.tensor_type.elem_type]().dtype.name
              for n in (IDS, MASK, POSITIONS) if n in inputs}
    last = len(logits_dims) == 3 and logits_dims[1].HasField("dim_value") \
        and logits_dims[1].dim_value == 1
    return DecoderInterface(
        pasts=tuple(pairs.items()), kv_heads=kv_heads, head_size=head,
        kv_dtype=NP_TYPES[past.type.tensor_type.elem_type]().dtype.name, vocab=int(vocab),
        shared=shared, length_input=LENGTH_INPUT in inputs, last_logits=last, dtypes=dtypes,
        position_limit=limit, tokens=token_ids(model, config, int(vocab)),
        model_type=config.get("model_type"),
        context_length=config.get("max_position_embeddings") or config.get("n_positions"),
        past_shapes=_own_shapes(inputs, pairs, kv_heads, head))


def _own_shapes(inputs, pairs, kv_heads: int, head: int) -> dict[str, tuple[int, int]]:
    """The pasts whose static kv heads or head size are not the first past's."""
    out = {}
    for name in pairs:
        dims = inputs[name].type.tensor_type.shape.dim
        if len(dims) != 4:
            continue
        own = (int(dims[1].dim_value or kv_heads), int(dims[3].dim_value or head))
        if own != (kv_heads, head):
            out[name] = own
    return out


def _cache_dims(dims, config: dict[str, Any], name: str) -> tuple[int, int]:
    """(kv heads, head size) from the past's static dims, else the HF config."""
    if len(dims) != 4:
        raise ConfigError(f"{name}: its past inputs are not [batch, kv_heads, length, head]")
    kv = dims[1].dim_value or config.get("num_key_value_heads") \
        or config.get("num_attention_heads")
    head = dims[3].dim_value or config.get("head_dim") or (
        config.get("hidden_size", 0) // max(1, config.get("num_attention_heads") or 1))
    if not kv or not head:
        raise ConfigError(f"{name}: its past inputs leave kv_heads/head_size symbolic and no "
                          "config.json says them", hint="put the HF config.json beside the model")
    return int(kv), int(head)


def hf_config(model: onnx.ModelProto, path: str | Path | None) -> dict[str, Any]:
    """What the model's metadata records of its HF config (``generation``), else the
    config.json and generation_config.json beside the file (Optimum's folder), else in the
    folder ``export --model`` recorded."""
    recorded = metadata.loaded(model, "generation")
    if recorded:
        return dict(recorded)
    folders = [Path(path).resolve().parent] if path else []
    hf = metadata.loaded(model, "hf_model") or {}
    if hf.get("folder"):
        folders.append(Path(hf["folder"]))
    for folder in folders:
        config = read_hf_json(folder) or read_genai_json(folder)
        if config:
            return config
    return {}


def read_genai_json(folder: Path) -> dict[str, Any]:
    """What an ONNX Runtime GenAI folder's genai_config.json says of the model, in the HF
    config's names (GenAI's builder writes no config.json beside its graph); {} without one.
    Its ``past_present_share_buffer``: a cache shared in place."""
    try:
        genai = json.loads((folder / "genai_config.json").read_text())
        model, search = genai["model"], genai.get("search", {})
        decoder = model["decoder"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return {}
    return {"model_type": model.get("type"), "vocab_size": model.get("vocab_size"),
            "eos_token_id": model.get("eos_token_id"), "pad_token_id": model.get("pad_token_id"),
            "bos_token_id": model.get("bos_token_id"),
            "max_position_embeddings": model.get("context_length"),
            "num_key_value_heads": decoder.get("num_key_value_heads"),
            "num_attention_heads": decoder.get("num_attention_heads"),
            "head_dim": decoder.get("head_size"), "hidden_size": decoder.get("hidden_size"),
            "past_present_share_buffer": search.get("past_present_share_buffer"),
            "source": str(folder / "genai_config.json")}


def read_hf_json(folder: Path) -> dict[str, Any]:
    """config.json with generation_config.json's token ids over it (as transformers reads
    them), as plain JSON; {} where the folder has no config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    config = config.get("text_config", {}) | config if "text_config" in config else config
    try:
        generation = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        generation = {}
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if generation.get(key) is not None:
            config[key] = generation[key]
    config["source"] = str(folder)
    return config


def token_ids(model: onnx.ModelProto, config: dict[str, Any], vocab: int) -> TokenIds:
    """EOS/pad/bos ids inside the vocabulary (GPT-2's 50256 in a 99-token test model is not
    one); where they came from."""
    def inside(value: Any) -> list[int]:
        values = value if isinstance(value, list) else [value]
        return [int(v) for v in values if isinstance(v, int) and 0 <= v < vocab]

    if not config:
        return TokenIds()
    eos = tuple(dict.fromkeys(inside(config.get("eos_token_id"))))
    pad, bos = inside(config.get("pad_token_id")), inside(config.get("bos_token_id"))
    return TokenIds(eos, pad[0] if pad else None, bos[0] if bos else None,
                    str(config.get("source", "metadata")))


def generation_record(config: Any) -> dict[str, Any]:
    """What a decoder's metadata records of its HF config for generation (a transformers
    config object or plain JSON)."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    text = get("text_config")
    if text is not None and not isinstance(text, dict):
        text = text.to_dict()
    keys = ("model_type", "vocab_size", "max_position_embeddings", "n_positions",
            "eos_token_id", "pad_token_id", "bos_token_id", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
            "sliding_window")
    out = {k: get(k) for k in keys if get(k) is not None}
    for key in keys:
        if key not in out and isinstance(text, dict) and text.get(key) is not None:
            out[key] = text[key]
    return out


def folder_generation(source: str | Path, model) -> dict[str, Any] | None:
    """The HF config beside a token decoder with a KV cache (Optimum's folder), recorded in
    ``model``'s metadata (what generate and GenAI read); None where the model is no such
    decoder, already records one or its folder has no config.json."""
    names = {i.name for i in model.graph.input}
    if metadata.read(model).get("generation") or IDS not in names \
            or "encoder_hidden_states" in names \
            or not any(o.name == LOGITS for o in model.graph.output) \
            or not metadata.loaded(model, "kv_cache"):
        return None
    config = read_hf_json(Path(source).resolve().parent)
    if not config:
        return None
    record = generation_record(config)
    metadata.write(model, {"generation": record})
    return record
