"""A folder ONNX Runtime GenAI runs as it is: ``genai_config.json`` beside a decoder this
project exported or fused, and the tokenizer files of the HF folder it came from.

GenAI reads the model's interface from the config: the input and output names (Optimum's,
which ours are), the cache's shape (kv heads, head size, layers), whether past and present
share one buffer (``past_present_share_buffer``: a ``fuse --kv-cache shared`` model, which
reads its cached length from the mask's shape as GenAI's own graphs do), the token ids and
the context length. Its generator right-pads a batch with ``pad_token_id`` and stops at
``eos_token_id``, both of which must lie inside the vocabulary. The model's windows are in
its graph (GroupQueryAttention's ``local_window_size`` over the whole buffer), so no
``sliding_window`` section is written: GenAI would slide the cache itself. Beside a
shared-cache fusion the config names the file genai_file.py writes (the fusion without its
per-layer Ifs) where that gives the fusion's outputs on GenAI's contract.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha_onnx.errors import ConfigError, OutputExistsError
from mha_onnx.graph.decoder import IDS, LOGITS, MASK, POSITIONS, DecoderInterface

CONFIG = "genai_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
# model types ONNX Runtime GenAI 0.18 runs as plain decoders (model_type.h's LLM list);
# any other architecture is written as its generic "decoder" (GPT-2 too: its "gpt2" type
# takes another model class, which looks for an input our interface does not have)
GENAI_TYPES = {"chatglm", "ernie4_5", "gemma", "gemma2", "gemma3_text", "granite",
               "internlm2", "llama", "mistral", "nemotron", "olmo", "phi", "phi3", "qwen2",
               "qwen3", "smollm3"}


@dataclass(frozen=True)
class GenAiFolder:
    """What was written for GenAI (or why not)."""

    config: str | None
    copied: tuple[str, ...] = ()
    reason: str = ""
    filename: str = ""  # the decoder file the config names (genai_file.py)
    file_note: str = ""
    tokenizer: bool = True  # a tokenizer beside the model (copied or already there)

    def note(self) -> str:
        if self.config is None:
            return f"{CONFIG} not written: {self.reason}"
        copied = f" and {len(self.copied)} tokenizer file(s)" if self.copied else ""
        if not self.tokenizer:
            copied += " (no tokenizer beside it or in the source folder: GenAI's Tokenizer " \
                      "needs one)"
        return f"{CONFIG} written for ONNX Runtime GenAI{copied}" + (
            f"; {self.file_note}" if self.file_note else "")

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "copied": list(self.copied), "reason": self.reason,
                "filename": self.filename, "file_note": self.file_note}


def _names(pairs: tuple[tuple[str, str], ...]) -> dict[str, str] | None:
    """GenAI's %d templates of the cache names, where every layer follows one (in any
    order)."""
    layers = len(pairs) // 2
    want = {(f"past_key_values.{n}.{kind}", f"present.{n}.{kind}")
            for n in range(layers) for kind in ("key", "value")}
    if len(pairs) % 2 or set(pairs) != want:
        return None
    return {f"{side}_{kind}_names": f"{prefix}.%d.{kind}" for kind in ("key", "value")
            for side, prefix in (("past", "past_key_values"), ("present", "present"))}


def genai_config(iface: DecoderInterface, filename: str, record: dict[str, Any]) -> dict:
    """The config GenAI reads for ``iface`` (the file ``filename``); ``record``: the HF
    config's fields (generation_record)."""
    names = _names(iface.pasts)
    if names is None:
        raise ValueError("cache names other than past_key_values.N.key/value")
    if iface.past_shapes:
        raise ValueError("its layers' caches differ in heads or head size (GenAI's config "
                         "takes one of each)")
    context = int(iface.position_limit or iface.context_length or record.get(
        "max_position_embeddings") or 4096)
    heads = int(record.get("num_attention_heads") or iface.kv_heads)
    inputs = {k: k for k in (IDS, MASK, POSITIONS) if k in iface.dtypes}
    inputs |= {k: v for k, v in names.items() if k.startswith("past")}
    outputs = {LOGITS: LOGITS} | {k: v for k, v in names.items() if k.startswith("present")}
    model_type = str(record.get("model_type") or iface.model_type or "decoder")
    tokens = iface.tokens
    return {
        "model": {
            "bos_token_id": tokens.bos if tokens.bos is not None else tokens.eos[0],
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename, "head_size": iface.head_size,
                "hidden_size": int(record.get("hidden_size") or heads * iface.head_size),
                "inputs": inputs, "outputs": outputs, "num_attention_heads": heads,
                "num_hidden_layers": len(iface.pasts) // 2,
                "num_key_value_heads": iface.kv_heads,
            },
            "eos_token_id": list(tokens.eos) if len(tokens.eos) > 1 else tokens.eos[0],
            "pad_token_id": tokens.pad if tokens.pad is not None else tokens.eos[0],
            "type": model_type if model_type in GENAI_TYPES else "decoder",
            "vocab_size": iface.vocab,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": context, "min_length": 0,
            "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
            "past_present_share_buffer": iface.shared, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        },
    }


def write_genai_folder(model: str | Path, source: str | Path | None,
                       record: dict[str, Any] | None = None) -> GenAiFolder:
    """``genai_config.json`` beside ``model`` and the tokenizer files of the HF folder
    ``source`` copied there (those the model's folder does not have yet)."""
    from mha_onnx.generate.genai_file import genai_file
    from mha_onnx.graph.decoder import hf_config, read_interface
    from mha_onnx.graph.files import read_model, write_bytes

    model = Path(model)
    proto = read_model(model, load_external_data=False)
    try:
        iface = read_interface(proto, model)
    except ConfigError as exc:  # a decoder generate cannot run: no folder, the reason said
        return GenAiFolder(None, reason=exc.args[0])
    record = record or hf_config(proto, model)
    if not iface.tokens.eos:
        return GenAiFolder(None, reason="the model names no eos_token_id inside its vocabulary "
                                        "(GenAI needs one to stop)")
    if iface.shared and iface.length_input:
        return GenAiFolder(None, reason="its shared cache takes past_sequence_length as an "
                                        "input, which GenAI does not feed (a model without a "
                                        "padding mask input)")
    try:
        config = genai_config(iface, model.name, record)
    except ValueError as exc:
        return GenAiFolder(None, reason=str(exc))
    made = genai_file(model, proto, iface)
    config["model"]["decoder"]["filename"] = made.filename
    target = model.with_name(CONFIG)
    write_bytes((json.dumps(config, indent=4) + "\n").encode(), target, force=True)
    copied = []
    if source is not None and Path(source).resolve() != model.parent.resolve():
        for name in TOKENIZER_FILES:
            found = Path(source) / name
            if found.is_file() and not (model.parent / name).exists():
                shutil.copyfile(found, model.parent / name)
                copied.append(name)
    tokenizer = any((model.parent / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
    return GenAiFolder(str(target), tuple(copied), filename=made.filename, file_note=made.note,
                       tokenizer=tokenizer)


def deliver_genai(output: str | Path, source: str | Path) -> str | None:
    """GenAI's folder beside a fused decoder (``genai_config.json``, the tokenizer files of
    ``source``'s folder, the GenAI file): what ``mha-onnx fuse`` writes after the model; its
    note, or None where the model records no decoder's generation config (fuse records the
    one of Optimum's folder, graph.decoder.folder_generation)."""
    from mha_onnx.graph import metadata
    from mha_onnx.graph.files import read_model

    record = metadata.loaded(read_model(output, load_external_data=False), "generation")
    if not record:
        return None
    return write_genai_folder(output, Path(source).resolve().parent, dict(record)).note()


def genai_clash(output: str | Path, force: bool) -> None:
    """Refuses (before any work) a decoder written into a folder whose genai_config.json
    names another model: GenAI's config of that one would be replaced silently (a folder
    holds one GenAI model). ``force``: replace it."""
    output = Path(output)
    config = output.parent / "genai_config.json"
    if force or not config.is_file():
        return
    try:
        named = json.loads(config.read_text())["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if named not in (output.name, output.name.replace(".onnx", ".genai.onnx")):
        raise OutputExistsError(f"{config} is GenAI's config of {named}: a second decoder in "
                                f"this folder would replace it",
                                hint="write each decoder into a folder of its own, or --force "
                                     "to replace it")
