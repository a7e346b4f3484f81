"""A Hugging Face model folder (``save_pretrained``: config + safetensors, nothing downloaded)
as ``export --model`` and ``validate`` need it: its task, the PyTorch module with the
interface ONNX Runtime tools speak (Optimum's names), and the fingerprint of its files.

Interfaces (Optimum's, so that ORT's tools and this project's validate/profile read them):

- ``text-generation-with-past``: ``input_ids`` [batch, sequence_length], ``attention_mask``
  [batch, past_sequence_length + sequence_length], ``position_ids`` [batch,
  sequence_length], ``past_key_values.N.key/value`` [batch, kv_heads,
  past_sequence_length, head_dim] -> ``logits``, ``present.N.key/value``.
- ``feature-extraction``: ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where
  the model has them) -> ``last_hidden_state``; a speech encoder fed raw samples (wav2vec2,
  HuBERT: :func:`is_audio`): ``input_values`` [batch, sequence_length] and
  ``attention_mask`` over the samples.
- ``image-feature-extraction``: ``pixel_values`` -> ``last_hidden_state``.
- ``text2text-generation-with-past`` (T5-style encoder-decoders), two files: the encoder
  (``input_ids``, ``attention_mask`` -> ``last_hidden_state``) and the decoder with its
  self-attention cache (``input_ids`` [batch, sequence_length], ``encoder_attention_mask``
  and ``encoder_hidden_states`` [batch, encoder_sequence_length(, d_model)],
  ``past_key_values.N.decoder.key/value`` -> ``logits``, ``present.N.decoder.key/value``;
  the cross-attention keys and values are computed from ``encoder_hidden_states`` at each
  step, an empty past is the first step).
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
    for weights in sorted(folder.glob("*.safetensors")):  # a truncated file: said up front
        _readable_safetensors(weights)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def _readable_safetensors(path: Path) -> None:
    """A safetensors file whose header and tensors lie within the file (a truncated or
    partly copied one is refused here, before anything is loaded)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as handle:
            handle.keys()
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type
        raise ModelFileError(f"cannot load {path.name}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}",
                             hint="the weights file is damaged or truncated; copy it again"
                             ) from None


def infer_task(config: Any) -> str:
    """The task of an architecture: ...ForCausalLM -> text generation with a cache, an
    encoder-decoder -> text2text, a vision config (pixels) -> image features, else the
    encoder's hidden states."""
    arch = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        if getattr(config, "vocab_size", None) is None:  # DETR and its kin: no tokens
            raise ConfigError(
                f"{arch or config.model_type} ({config.model_type}) is an encoder-decoder "
                "without a vocabulary (object detection): not a task export --model takes",
                hint="export it with Optimum (--task object-detection) and run mha-onnx "
                     "fuse on the file")
        return "text2text-generation-with-past"
    if "ForCausalLM" in arch or "LMHeadModel" in arch:  # GPT-2's GPT2LMHeadModel
        return "text-generation-with-past"
    if hasattr(config, "image_size") and hasattr(config, "num_channels"):
        return "image-feature-extraction"
    return "feature-extraction"


def check_task(config: Any, task: str) -> None:
    """Refuses a ``--task`` the architecture cannot have (before anything is loaded): images
    for a model without an image size, generation with a cache for an encoder or a vision
    model, an encoder-decoder's task for a model that is not one."""
    own = infer_task(config)
    arch = " ".join(getattr(config, "architectures", None) or []) or config.model_type
    images = hasattr(config, "image_size") and hasattr(config, "num_channels")
    wrong = (task == "image-feature-extraction" and not images) \
        or (task == "text2text-generation-with-past"
            and not getattr(config, "is_encoder_decoder", False)) \
        or (task == "text-generation-with-past" and (images or getattr(
            config, "is_encoder_decoder", False)))
    if wrong:
        raise ConfigError(f"--task {task} does not fit {arch} ({config.model_type}): "
                          f"its task is {own}", hint="--task auto picks it")


def is_audio(config: Any) -> bool:
    """A speech encoder fed raw samples: its features come from a stack of 1-D convolutions
    (``conv_kernel``/``conv_stride``, as wav2vec2, HuBERT, WavLM, Data2VecAudio have)."""
    return bool(getattr(config, "conv_kernel", None)) and bool(getattr(config, "conv_stride",
                                                                           None))


def min_samples(config: Any) -> int:
    """The fewest samples the convolution stack turns into one feature frame."""
    samples = 1
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride,
                                            strict=True))):
        samples = (samples - 1) * int(stride) + int(kernel)
    return samples


def load_module(folder: str | Path, task: str, dtype: str = "float32") -> Any:
    """The PyTorch model of ``folder`` for ``task``, in eval mode and ``dtype``."""
    import torch
    import transformers as tf

    classes = {"text-generation-with-past": tf.AutoModelForCausalLM,
               "feature-extraction": tf.AutoModel, "image-feature-extraction": tf.AutoModel,
               "text2text-generation-with-past": tf.AutoModelForSeq2SeqLM}
    if task not in classes:
        raise ConfigError(f"task {task} is not exported yet",
                          hint=f"tasks: {', '.join(classes)}")
    model = None
    # SDPA where the architecture has it, else its default; T5's SDPA path views a transposed
    # tensor that torch.export cannot decompose, so encoder-decoders load eager
    order = ("eager", None) if task == "text2text-generation-with-past" else ("sdpa", None)
    # transformers' grouped_mm experts are a custom op torch.export cannot lower; bmm it can
    experts = {"experts_implementation": "batched_mm"} if _has_experts(folder) else {}
    tf.utils.logging.disable_progress_bar()  # (its "Loading weights" bars are not ours to show)
    for attn in order:
        try:
            extra = {"attn_implementation": attn, **experts} if attn else dict(experts)
            model = classes[task].from_pretrained(folder, local_files_only=True, **extra)
            break
        except Exception as exc:  # noqa: BLE001 - the folder's files: truncated, mismatched
            if attn is None:
                text = " ".join(str(exc).split())[:300]
                raise ModelFileError(f"transformers cannot load {folder} for {task}: "
                                     f"{type(exc).__name__}: {text}",
                                     hint="check the folder's config and weights (a truncated "
                                          "or partly copied file?)") from None
    model = model.eval()
    return model.to(torch.float16) if dtype == "float16" else model.float()


class DecoderWithPast:
    """``forward(input_ids, attention_mask, position_ids, *pasts)`` -> (logits, *presents),
    a DynamicCache built from the pasts (key, value per layer)."""

    def __init__(self, model: Any) -> None:
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner
                self.cache_arg = _cache_argument(inner)

            def forward(self, input_ids, attention_mask, position_ids, *pasts):
                # every layer a full (append-only) cache, also those with a sliding window
                # (their masks apply the window): the presents keep the appended interface
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=True,
                                 **{self.cache_arg: _cache_of(pasts)})
                return (out.logits, *_presents(_returned_cache(out)))

        self.module = Wrapped(model).eval()
        self.layers = int(model.config.num_hidden_layers)


class Seq2SeqParts:
    """An encoder-decoder's two exported parts as modules: ``encoder(input_ids,
    attention_mask)`` -> last_hidden_state; ``decoder(input_ids, encoder_attention_mask,
    encoder_hidden_states, *pasts)`` -> (logits, *presents) of the self-attention cache."""

    def __init__(self, model: Any) -> None:
        import torch

        class Encoder(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask):
                return self.inner(input_ids=input_ids,
                                  attention_mask=attention_mask).last_hidden_state

        class Decoder(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner
                self.cache_arg = _cache_argument(inner)

            def forward(self, input_ids, encoder_attention_mask, encoder_hidden_states, *pasts):
                from transformers.cache_utils import DynamicCache, EncoderDecoderCache

                cache = EncoderDecoderCache(_cache_of(pasts), DynamicCache())  # cross K/V:
                out = self.inner(decoder_input_ids=input_ids,  # computed at every step
                                 attention_mask=encoder_attention_mask,
                                 encoder_outputs=(encoder_hidden_states,), use_cache=True,
                                 **{self.cache_arg: cache})
                return (out.logits, *_presents(_returned_cache(out).self_attention_cache))

        self.encoder = Encoder(model.get_encoder()).eval()
        self.decoder = Decoder(model).eval()
        config = model.config
        self.layers = decoder_layers(config)


def _cache_argument(model: Any) -> str:
    """transformers 5.24 names the cache ``cache``; before (and deprecated since),
    ``past_key_values``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(pasts) -> Any:
    """A DynamicCache holding (key, value) per layer from the flat ``pasts``."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    for layer in range(len(pasts) // 2):
        cache.update(pasts[2 * layer], pasts[2 * layer + 1], layer)
    return cache


def _returned_cache(out: Any) -> Any:
    made = getattr(out, "cache", None)
    return made if made is not None else out.past_key_values


def check_decoder(model: Any, config: Any) -> None:
    """Refuses, before torch.export's minutes, a model whose forward returns no cache
    (an encoder loaded under a causal-LM head: BERT's BertLMHeadModel without
    ``is_decoder``): one eager step of two tokens."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2]]), use_cache=True)
    if _returned_cache(out) is None:
        arch = " ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ConfigError(f"--task text-generation-with-past does not fit {arch} "
                          f"({config.model_type}): its forward returns no cache (its task "
                          f"is {infer_task(config)})", hint="--task auto picks it")


def _presents(cache: Any) -> list:
    """[key, value] per layer of a DynamicCache, flat."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def decoder_layers(config: Any) -> int:
    """How many layers an encoder-decoder's decoder has (T5's or BART's names)."""
    for name in ("decoder_layers", "num_decoder_layers", "num_layers"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ConfigError(f"{config.model_type}: cannot tell how many decoder layers it has")


def cache_shape(config: Any) -> tuple[int, int]:
    """(kv heads, head size) of a decoder's cache."""
    if getattr(config, "is_encoder_decoder", False):  # T5's and BART's names
        heads = int(getattr(config, "decoder_attention_heads", None) or config.num_heads)
        return heads, int(getattr(config, "d_kv", None) or config.d_model // heads)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv, head


def _has_experts(folder: str | Path) -> bool:
    """Is the folder's model a mixture of experts (by its config's expert count: num_experts,
    n_routed_experts, num_local_experts, ERNIE's moe_num_experts, ...)?"""
    config = json.loads((Path(folder) / "config.json").read_text())
    return any(key.endswith("_experts") and type(value) is int and value > 0
               for key, value in config.items())


def layer_cache_shapes(model: Any, config: Any) -> list[tuple[int, int, int, int]]:
    """Each decoder layer's cache as the model itself makes it: (key heads, key head size,
    value heads, value head size), read off one short run with a cache. The config's
    ``num_key_value_heads`` is not every layer's: MiMo-V2-Flash's sliding-window layers
    keep all heads, its full-attention layers two; MLA's values are narrower than its keys.
    Where that run fails, the config's shape for every layer."""
    import torch

    kv, head = cache_shape(config)
    fallback = [(kv, head, kv, head)] * int(config.num_hidden_layers)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.ones(1, 2, dtype=torch.int64), use_cache=True)
        presents = _presents(_returned_cache(out))
        shapes = [(int(k.shape[1]), int(k.shape[3]), int(v.shape[1]), int(v.shape[3]))
                  for k, v in zip(presents[::2], presents[1::2], strict=True)]
    except Exception:  # noqa: BLE001 - the config's shape, as before
        return fallback
    return shapes if len(shapes) == len(fallback) else fallback


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
        self.part = record.get("part")  # an encoder-decoder's "encoder" or "decoder"
        if self.task == "text2text-generation-with-past":
            parts = Seq2SeqParts(self.model)
            self.decoder = parts.encoder if self.part == "encoder" else parts.decoder
        self.label = label

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
        with torch.no_grad():
            if self.task == "image-feature-extraction":
                return _encoded(self.model(pixel_values=t["pixel_values"].float()))
            if self.task == "feature-extraction":  # input_values of a half export: float32
                t = {k: v.float() if v.is_floating_point() else v for k, v in t.items()}
                return _encoded(self.model(**t))
            if self.part == "encoder":
                return {"last_hidden_state": _np(self.decoder(t["input_ids"],
                                                              t["attention_mask"]))}
            seq2seq = self.part == "decoder"
            infix = ".decoder" if seq2seq else ""
            layers = sum(1 for k in t if k.startswith("past_key_values.")) // 2
            pasts = [t[f"past_key_values.{n}{infix}.{kind}"].float() for n in range(layers)
                     for kind in ("key", "value")]
            head = (t["input_ids"], t["encoder_attention_mask"],
                    t["encoder_hidden_states"].float()) if seq2seq else (
                t["input_ids"], t["attention_mask"], t["position_ids"])
            outs = self.decoder(*head, *pasts)
        names = ["logits"] + [f"present.{n}{infix}.{kind}" for n in range(layers)
                              for kind in ("key", "value")]
        return {name: _np(value) for name, value in zip(names, outs, strict=True)}


def encoder_outputs(model: Any) -> list[str]:
    """An encoder's outputs as Optimum names them: its hidden states, and the pooler's
    output where it has a pooler (BERT's, ViT's: tanh of a dense layer on the first token)."""
    return ["last_hidden_state"] + (["pooler_output"] if getattr(model, "pooler", None)
                                    is not None else [])


def _encoded(out: Any) -> dict[str, np.ndarray]:
    found = {"last_hidden_state": _np(out.last_hidden_state)}
    if getattr(out, "pooler_output", None) is not None:
        found["pooler_output"] = _np(out.pooler_output)
    return found


def _np(x: Any) -> np.ndarray:
    return x.detach().float().numpy()


def describe(config: Any) -> str:
    return json.dumps({k: getattr(config, k, None) for k in (
        "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
        "num_key_value_heads")})
