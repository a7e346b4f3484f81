"""``export --dtype float16 --keep-float32 MODULE``: named modules of a float16 model kept in
float32, the way a user keeps a layer whose activations pass float16's range (65504) out of
it.

Each kept module's parameters and buffers are float32; its float16 inputs are cast up on the
way in and its float32 outputs back to float16 on the way out (forward hooks, so the module
keeps its name and the export its name scopes). The values a kept module computes inside
(a product of two large projections, a sum of squares) never meet float16; what leaves it
must fit float16 again. A module that writes the cache (an attention block, a decoder
layer) would hand the cache float32 keys: refused before the export where a kept module
holds an attention block of the part that writes the cache (a decoder; an encoder-decoder's
decoder, whose self- and cross-attention both cache: its encoder may be kept), and after it
by the cache's type (what the names did not show); a module whose weights another shares (a
tied LM head) is refused too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any

from mha_onnx.errors import ConfigError

SHOWN = 6


def keep_float32(model: Any, patterns: Sequence[str], cache_writer: Any = None) -> list[str]:
    """Keep the modules of ``model`` whose names match ``patterns`` (globs on PyTorch's
    module names, e.g. ``model.layers.3.mlp`` or ``model.layers.*.mlp.act_fn``) in float32;
    the names kept, outermost only. A pattern that names no module is refused, and one that
    holds an attention block of ``cache_writer`` (the module whose attention writes the
    cache: the model for a decoder, its decoder for an encoder-decoder; None: no cache)."""
    names = [name for name, _ in model.named_modules() if name]
    matched: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits:
            near = [n for n in names if n.count(".") <= 3 and "layers.0." in f"{n}."][:SHOWN] \
                or names[:SHOWN]
            raise ConfigError(f"--keep-float32 {pattern!r} names no module of the model",
                              hint="module names as PyTorch gives them, globs allowed; e.g. "
                                   + ", ".join(near))
        matched.extend(h for h in hits if h not in matched)
    kept = [n for n in matched if not any(n.startswith(f"{o}.") for o in matched if o != n)]
    writers = set() if cache_writer is None else {
        id(m) for m in cache_writer.modules() if type(m).__name__.endswith("Attention")}
    attention = [f"{n} holds {type(m).__name__}" for n in kept
                 for m in model.get_submodule(n).modules() if id(m) in writers]
    if attention:
        _cache_refused(kept, attention[0])
    _tied_refused(model, kept)
    for name in kept:
        module = model.get_submodule(name)
        module.float()
        module.register_forward_pre_hook(_up, with_kwargs=True)
        module.register_forward_hook(_down)
    return kept


def kept_for_task(model: Any, task: str, patterns: Sequence[str],
                  progress: Callable[[str], None]) -> tuple[list[str], dict[str, str]]:
    """``export --model``'s kept modules (:func:`keep_float32`, the cache's writer by the
    task); and each exported part's module name in the whole model where the names its
    export records start below it (an encoder-decoder's encoder part: ``block.0...`` for
    T5's ``encoder.block.0...``), so that a refusal names a module as this takes it."""
    seq2seq = task == "text2text-generation-with-past"
    writer = model if task == "text-generation-with-past" else \
        model.get_decoder() if seq2seq else None  # (whose attention writes the cache)
    kept = keep_float32(model, patterns, cache_writer=writer)
    if kept:
        progress(f"kept in float32: {', '.join(kept)}")
    if not seq2seq:
        return kept, {}
    encoder = model.get_encoder()
    return kept, {"encoder": next(n for n, m in model.named_modules() if m is encoder)}


def _tied_refused(model: Any, kept: Sequence[str]) -> None:
    """A kept module whose weights another module shares (a tied LM head and embedding)
    would turn the other's weights float32 too: refused, naming both."""
    inside = {id(p): name for name in kept
              for p in model.get_submodule(name).parameters()}
    for name, module in model.named_modules():
        if any(name == k or name.startswith(f"{k}.") for k in kept):
            continue
        shared = [inside[id(p)] for p in module.parameters(recurse=False) if id(p) in inside]
        if shared:
            raise ConfigError(f"--keep-float32 {shared[0]}: its weights are {name}'s too "
                              "(tied), which would turn float32 with them",
                              hint=f"keep both ({shared[0]} and {name}) or neither")


def _cast(value: Any, source: Any, target: Any) -> Any:
    """``value`` with its ``source``-typed tensors (in tuples, lists, dicts) as ``target``."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(target) if value.dtype == source else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_cast(v, source, target) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, source, target) for v in value)
    if isinstance(value, dict):  # (a ModelOutput is a dict that keeps its fields in order)
        for key in list(value.keys()):
            value[key] = _cast(value[key], source, target)
        return value
    return value


def _up(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    import torch

    return _cast(args, torch.float16, torch.float32), _cast(kwargs, torch.float16, torch.float32)


def _down(_module: Any, _args: tuple, output: Any) -> Any:
    import torch

    return _cast(output, torch.float32, torch.float16)


def cache_kept_float16(outputs: Sequence[tuple[str, int]], kept: Sequence[str]) -> None:
    """Refuse an export whose cache outputs (``present*``: name, ONNX element type) came out
    float32 because a kept module writes the cache (what keep_float32 did not see)."""
    from onnx import TensorProto

    wide = [name for name, kind in outputs if kind == TensorProto.FLOAT and "present" in name]
    if kept and wide:
        _cache_refused(kept, f"{wide[0]} is float32")


def _cache_refused(kept: Sequence[str], why: str) -> None:
    raise ConfigError(f"--keep-float32 {', '.join(kept)}: the cache would be float32 ({why}): "
                      "a kept module writes it (an attention block or a whole layer)",
                      hint="keep the parts that overflow instead: the MLP, a norm, a "
                           "projection (e.g. model.layers.N.mlp)")
