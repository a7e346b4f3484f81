"""The shapes fuse verifies a rewrite at: the default cases (every dynamic dim varied, masks
with padding, a fully padded batch entry) and every kind of run a branch of a chosen form
takes (read from the forms' fields, rewrite/forms.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import onnx

from mha_onnx.graph.expressions import evaluate, symbols
from mha_onnx.graph.inputs import ShapeCase, case_for, default_cases, input_specs, split_dims
from mha_onnx.graph.roles import length_limit
from mha_onnx.rewrite.forms import CHUNK, COUNTED, LEFT_PADDED, NO_PAST, ONE_TOKEN, UNPADDED


def input_length(keys: str, n: int, limit: int = 1 << 24) -> tuple[str, int] | None:
    """(input dim, its least value at which ``keys``, an expression of that one dim, is at
    least ``n``), or None where it has other symbols or never gets there (keys grow with
    the input: doubling, then bisecting)."""
    names = symbols(keys)
    if len(names) != 1:
        return None
    name = names.pop()

    def reaches(length: int) -> bool:
        value = evaluate(keys, {name: length})
        return value is not None and value >= n

    high = 1
    while not reaches(high):
        high *= 2
        if high > limit:
            return None
    low = high // 2  # does not reach (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return name, high


def _cache_and_new_lengths(specs) -> tuple[set[str], set[str]]:
    """The dims of the caches' lengths and of the new positions (the query's seq_q, a
    decoder's input_ids). A length that is also a whole 2-D input's (T5's encoder keys, with
    their encoder_attention_mask) is a memory of fixed length, which no prompt starts empty."""
    fixed = {s.dims[1] for s in specs if len(s.dims) == 2}
    cache = {s.dims[2] for s in specs if len(s.dims) == 4 and isinstance(s.dims[2], str)
             and s.dims[2] not in fixed}
    new = {s.dims[1] for s in specs if len(s.dims) in (2, 3) and s.role != "mask"
           and isinstance(s.dims[1], str)}
    return cache, new


def verification_cases(original: onnx.ModelProto, results: Sequence[Any]) -> list[ShapeCase]:
    """The default cases, plus every kind of run a branch of a chosen form takes: key lengths
    at which a guard first picks its other branch, a prompt without past, decode steps and
    unpadded batches (read from each form's fields, never from its label). ``results``: the
    fuse report's blocks (each with its ``chosen`` form, None where left)."""
    specs = input_specs(original)
    table = length_limit(original)  # past and new positions both count against a table
    cases = default_cases(specs, max_len=max(1, min(64, table // 2)) if table else 64)
    forms = [r.chosen for r in results if r.chosen is not None]
    kinds = {c for form in forms for c in form.all_cases()}
    odd = cases[1]
    cases += _threshold_cases(specs, forms)
    branches = [odd]
    steps = []  # a prompt, and one step after a past
    chunks = []  # a prompt's later chunk (in one row)
    cache, new = _cache_and_new_lengths(specs)
    prompt = None
    if NO_PAST in kinds:  # a KV-cache model's prompt
        prompt = ShapeCase("no past (prompt)", {**odd.dims, **dict.fromkeys(cache, 0)}, "some")
        cases.append(prompt)
        steps.append(prompt)
    if ONE_TOKEN in kinds:  # its decode steps
        cases.append(ShapeCase("one new token (decode)", {**odd.dims, **dict.fromkeys(new, 1)},
                               "some"))
        branches.append(cases[-1])
        steps.append(cases[-1])
    if CHUNK in kinds:  # a prompt's later chunk in one row: its past padded or not
        chunks = _chunk_cases(specs, odd)
        cases += chunks
        chunks = chunks[:1]  # (windows, counted positions: a window takes no padded key)
    if UNPADDED in kinds:  # the branch only unpadded runs take (a prompt's too)
        cases += [replace(c, label=f"{c.label}, no key padded", padding="none")
                  for c in branches + ([prompt] if prompt is not None else [])]
    for window in sorted({w for form in forms for w in form.reaches()} & set(range(513))):
        longer, label = window + 3, f"past the window ({window})"  # (sizes a position table
        if not steps:  # may refuse: optional)
            cases.append(replace(case_for(specs, label, 2, [longer]), optional=True))
        for case in steps + chunks:  # the prompt: more new positions; else more cached
            axes = new if case is prompt else cache
            cases.append(replace(case, label=f"{case.label}, {label}", optional=True,
                                 dims={**case.dims, **dict.fromkeys(axes, longer)}))
    if COUNTED in kinds:  # position ids a generation loop counts up (rotary_fold.py)
        counted = tuple(sorted({f.positions for form in forms for f in form.chain()
                                if f.positions}))
        cases += [replace(c, label=f"{c.label}, positions counted{how}", counted=counted,
                          padding=padding)
                  for c in steps or [odd] for how, padding in (("", c.padding),
                                                               (", no key padded", "none"))]
        cases += [replace(c, label=f"{c.label}, positions counted", counted=counted)
                  for c in chunks]
    if LEFT_PADDED in kinds:  # per-row lengths: rows padded before their first key, batch 4
        batch = {n: 4 for n in split_dims(specs)[0]}
        cases += [replace(c, label=f"{c.label}, left-padded rows", padding="left",
                          dims={**c.dims, **batch}) for c in steps]
    return cases


def _threshold_cases(specs, forms) -> list[ShapeCase]:
    """Past each key length at which a guard first picks its other branch (optional)."""
    cases = []
    for n, keys in sorted({(n, form.keys) for form in forms for n in form.switches()}):
        case = case_for(specs, f"past a form threshold ({n})", 2, [n + 1, n], "some")
        crossing = input_length(keys, n) if keys else None
        if crossing is not None:  # keys computed from an input dim: where they reach n
            name, length = crossing
            case = replace(case, label=f"past a form threshold ({n} keys)",
                           dims={**case.dims, name: length})
        cases.append(replace(case, optional=True))
    return cases


def _chunk_cases(specs, odd: ShapeCase) -> list[ShapeCase]:
    """A prompt's later chunk in one row (``odd``'s lengths at batch 1): no key padded, and
    its first quarter of keys padded (a left-padded prompt, all inside the past)."""
    one = dict.fromkeys(split_dims(specs)[0], 1)
    return [ShapeCase(f"a chunk after a past (one row{how})", {**odd.dims, **one}, padding,
                      pad_fraction=0.25)
            for how, padding in ((", no key padded", "none"), (", its past padded", "front"))]
