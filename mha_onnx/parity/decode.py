"""Decoding with a KV cache as production runs it: a prompt (no past), then single-token
steps, each runtime feeding its own ``present`` outputs back as the next ``past`` inputs;
every step of every runtime compared with every reference's own chain; and what a run
of a KV-cache decoder computes at the positions its mask pads, left out of every comparison
(blank_padded: never read, and runtimes differ there)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mha_onnx.graph.inputs import InputSpec, ShapeCase, case_for, make_inputs

PROMPT = 7


def _step_feeds(specs: Sequence[InputSpec], pairs: Mapping[str, str], previous: Mapping | None,
                batch: int, rng: np.random.Generator, step: int, padded: bool = True
                ) -> dict[str, np.ndarray]:
    """Inputs of one step: fresh data inputs of one token (the prompt: PROMPT tokens), the
    previous presents as pasts, masks extended by a kept key."""
    past_len = 0 if previous is None else next(iter(previous[o] for o in pairs.values())).shape[2]
    new = PROMPT if previous is None else 1
    case = case_for(specs, "step", batch, [new], "none")
    dims = dict(case.dims)
    for spec in specs:
        if spec.name in pairs and isinstance(spec.dims[2], str):
            dims[spec.dims[2]] = past_len
    feeds = make_inputs(specs, ShapeCase("step", dims, "none"), seed=int(rng.integers(1 << 30)))
    for past, present in pairs.items():
        if previous is not None:
            feeds[past] = previous[present]
    return _left_padded(specs, feeds, batch, step) if padded else feeds


def _left_padded(specs: Sequence[InputSpec], feeds: dict[str, np.ndarray], batch: int,
                 step: int) -> dict[str, np.ndarray]:
    """Mask inputs over all keys: row b has its first b keys padded (left padding, as
    batched generation pads shorter prompts), every later key kept."""
    for spec in specs:
        if spec.role == "mask" and feeds[spec.name].ndim == 2:
            total = feeds[spec.name].shape[1]
            padded = np.zeros((batch, total), dtype=bool)
            for b in range(batch):
                padded[b, :min(b, PROMPT - 1)] = True
            feeds[spec.name] = padded if spec.dtype == np.bool_ else (~padded).astype(spec.dtype)
    return feeds


def decode_chains(runtimes: Mapping[str, object], specs: Sequence[InputSpec],
                  pairs: Mapping[str, str], steps: int, batch: int = 2, seed: int = 0,
                  padded: bool = True
                  ) -> list[tuple[str, dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]]:
    """Run every runtime's own chain: [(step label, {runtime: outputs}, feeds of the first
    runtime)] for the prompt and ``steps`` single-token steps. The new-token inputs are the
    same for all; the pasts are each runtime's own presents. ``padded``: rows left-padded
    (batched generation) or none (the branch fused forms take when no key is padded)."""
    rng = np.random.default_rng(seed)
    previous: dict[str, Mapping | None] = dict.fromkeys(runtimes)
    out = []
    for step in range(steps + 1):
        fresh = _step_feeds(specs, pairs, None if step == 0 else next(iter(previous.values())),
                            batch, rng, step, padded)
        results = {}
        for key, runtime in runtimes.items():
            feeds = dict(fresh)
            if previous[key] is not None:
                feeds.update({past: previous[key][present] for past, present in pairs.items()})
            results[key] = runtime.infer(feeds)
            previous[key] = results[key]
        label = "prompt" if step == 0 else f"step {step}"
        out.append((label, results, fresh))
    return out


def has_padding_mask(specs: Sequence[InputSpec]) -> bool:
    """Does the model take a [B, T] padding mask (so that padded and unpadded chains differ)?"""
    return any(spec.role == "mask" and len(spec.dims) == 2 for spec in specs)


def blank_padded(outputs: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], specs,
                  out_dims, presents: set[str]) -> dict[str, np.ndarray]:
    """Outputs of a KV-cache decoder's run with the positions its [B, past + new] padding
    mask pads set to 0: what a model computes there is never read (the mask hides those keys
    from every later query, and no token is taken from a padded position), and runtimes
    differ there (a padded query of a left-padded prompt has no key to attend to, nor one
    whose sliding window holds only padding). Axes are matched by the mask's dim name, or by
    the new tokens' (the mask's last columns: a prompt's all of them); a present's sequence
    axis is its third (a shared cache's buffers are named otherwise)."""
    mask_spec = next((s for s in specs if s.role == "mask" and len(s.dims) == 2), None)
    if mask_spec is None or mask_spec.name not in feeds:
        return dict(outputs)
    mask = np.asarray(feeds[mask_spec.name])
    keep = ~mask if mask.dtype == np.bool_ else mask != 0  # bool masks here mark the padded
    if keep.all():
        return dict(outputs)
    names = {mask_spec.dims[1]} | {s.dims[1] for s in specs if s.role != "mask"
                                    and len(s.dims) == 2 and isinstance(s.dims[1], str)}
    def positions(a: int, dim, name: str, size: int) -> bool:
        """Is axis ``a`` (``dim``, ``size`` long) of output ``name`` over the mask's
        positions: all of them, or (a dim of the new tokens) its last ``size``?"""
        if a == 0 or not (dim in names or (name in presents and a == 2)):
            return False
        return size == keep.shape[1] or (dim != mask_spec.dims[1] and 0 < size < keep.shape[1])

    out = {}
    for name, value in outputs.items():
        axis = next((a for a, d in enumerate(out_dims.get(name, [])[:value.ndim])
                     if positions(a, d, name, value.shape[a])), None)
        if axis is None or value.shape[0] != keep.shape[0]:
            out[name] = value
            continue
        kept = keep[:, keep.shape[1] - value.shape[axis]:]  # all, or the new tokens' columns
        shape = [keep.shape[0]] + [1] * (value.ndim - 1)
        shape[axis] = kept.shape[1]
        out[name] = np.where(kept.reshape(shape), value, np.zeros((), value.dtype))
    return out
