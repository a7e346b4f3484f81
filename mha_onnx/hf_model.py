"""A Hugging Face model folder (``save_pretrained``: config + safetensors, nothing downloaded)
as ``export --model`` and ``validate`` need it: its task, the PyTorch module with the
interface ONNX Runtime tools speak (Optimum's names), and the fingerprint of its files.

Interfaces (Optimum's, so that ORT's tools and this project's validate/profile read them):

- ``text-generation-with-past``: ``input_ids`` [batch, sequence_length], ``attention_mask``
  [batch, past_sequence_length + sequence_length], ``position_ids`` [batch,
  sequence_length], ``past_key_values.N.key/value`` [batch, kv_heads,
  past_sequence_length, head_dim] -> ``logits``, ``present.N.key/value``.
- ``feature-extraction``: ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where
  the model has them) -> ``last_hidden_state``.
- ``image-feature-extraction``: ``pixel_values`` -> ``last_hidden_state``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError, ModelFileError

TASKS = ("auto", "feature-extraction", "text-generation-with-past", "image-feature-extraction",
         "text2text-generation-with-past")
WEIGHT_FILES = ("*.safetensors", "*.bin")


def fingerprint(folder: Path) -> dict[str, str]:
    """sha256 of config.json and of every weight file, by file name."""
    out = {}
    for pattern in ("config.json", *WEIGHT_FILES):
        for path in sorted(folder.glob(pattern)):
            out[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def read_config(folder: str | Path) -> Any:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelFileError(f"{folder} has no config.json",
                             hint="pass a folder written by save_pretrained (config + weights)")
    if not any(folder.glob(p) for p in WEIGHT_FILES):
        raise ModelFileError(f"{folder} has no weights (*.safetensors or *.bin)",
                             hint="nothing is downloaded: save the weights into the folder")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def infer_task(config: Any) -> str:
    """The task of an architecture: ...ForCausalLM -> text generation with a cache, an
    encoder-decoder -> text2text, a vision config (pixels) -> image features, else the
    encoder's hidden states."""
    arch = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return "text2text-generation-with-past"
    if "ForCausalLM" in arch:
        return "text-generation-with-past"
    if hasattr(config, "image_size") and hasattr(config, "num_channels"):
        return "image-feature-extraction"
    return "feature-extraction"


def load_module(folder: str | Path, task: str, dtype: str = "float32") -> Any:
    """The PyTorch model of ``folder`` for ``task``, in eval mode and ``dtype``."""
    import torch
    import transformers as tf

    classes = {"text-generation-with-past": tf.AutoModelForCausalLM,
               "feature-extraction": tf.AutoModel, "image-feature-extraction": tf.AutoModel}
    if task not in classes:
        raise ConfigError(f"task {task} is not exported yet",
                          hint=f"tasks: {', '.join(classes)}")
    model = None
    for attn in ("sdpa", None):  # SDPA where the architecture has it, else its default
        try:
            extra = {"attn_implementation": attn} if attn else {}
            model = classes[task].from_pretrained(folder, local_files_only=True, **extra)
            break
        except (ValueError, OSError) as exc:
            if attn is None:
                raise ModelFileError(f"transformers cannot load {folder} for {task}: "
                                     f"{exc}") from None
    model = model.eval()
    return model.to(torch.float16) if dtype == "float16" else model.float()


class DecoderWithPast:
    """``forward(input_ids, attention_mask, position_ids, *pasts)`` -> (logits, *presents),
    a DynamicCache built from the pasts (key, value per layer)."""

    def __init__(self, model: Any) -> None:
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                import inspect

                super().__init__()
                self.inner = inner  # transformers 5.24 names the cache `cache`; before, and
                # deprecated since, `past_key_values`
                params = inspect.signature(inner.forward).parameters
                self.cache_arg = "cache" if "cache" in params else "past_key_values"

            def forward(self, input_ids, attention_mask, position_ids, *pasts):
                from transformers.cache_utils import DynamicCache

                # every layer a full (append-only) cache, also those with a sliding window
                # (their masks apply the window): the presents keep the appended interface
                cache = DynamicCache()
                for layer in range(len(pasts) // 2):
                    cache.update(pasts[2 * layer], pasts[2 * layer + 1], layer)
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=True,
                                 **{self.cache_arg: cache})
                made = getattr(out, "cache", None)
                presents = []
                for layer in (made if made is not None else out.past_key_values).layers:
                    presents += [layer.keys, layer.values]
                return (out.logits, *presents)

        self.module = Wrapped(model).eval()
        self.layers = int(model.config.num_hidden_layers)


def cache_shape(config: Any) -> tuple[int, int]:
    """(kv heads, head size) of a decoder's cache."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv, head


class HfReference:
    """``validate``'s PyTorch reference for a model exported by ``export --model``: the
    folder's model in float32, fed the ONNX model's inputs by name, its outputs named as
    the ONNX model's."""

    def __init__(self, record: Mapping[str, Any], label: str) -> None:
        folder = Path(record["folder"])
        if not folder.is_dir():
            raise ModelFileError(f"{label}: the model folder {folder} recorded at export is gone",
                                 hint="pass --reference ORIGINAL.onnx instead")
        self.digest_ok = fingerprint(folder) == record.get("files")
        self.task = record["task"]
        self.model = load_module(folder, self.task, "float32")
        self.decoder = (DecoderWithPast(self.model).module
                        if self.task == "text-generation-with-past" else None)
        self.label = label

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
        with torch.no_grad():
            if self.task == "image-feature-extraction":
                return {"last_hidden_state": _np(self.model(
                    pixel_values=t["pixel_values"].float()).last_hidden_state)}
            if self.task == "feature-extraction":
                return {"last_hidden_state": _np(self.model(**t).last_hidden_state)}
            pasts = [t[f"past_key_values.{n}.{kind}"].float()
                     for n in range(int(self.model.config.num_hidden_layers))
                     for kind in ("key", "value")]
            outs = self.decoder(t["input_ids"], t["attention_mask"], t["position_ids"], *pasts)
        names = ["logits"] + [f"present.{n}.{kind}" for n in range(len(pasts) // 2)
                              for kind in ("key", "value")]
        return {name: _np(value) for name, value in zip(names, outs, strict=True)}


def _np(x: Any) -> np.ndarray:
    return x.detach().float().numpy()


def describe(config: Any) -> str:
    return json.dumps({k: getattr(config, k, None) for k in (
        "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
        "num_key_value_heads")})
