"""One inputs API for every stage and tool: what each model input is (recognised by how the
graph uses it, not by its name), inputs that honour the dynamic dims (one value per symbolic
dim, so dims that must agree do), padding patterns, a padded fraction of keys, user-given
inputs (``--inputs FILE.npz``), and the memory check that refuses shapes that cannot fit.

No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from mha_onnx.errors import InputSpecError
from mha_onnx.graph.dims import dim_floors, floor_dims, lifted, relate_dims
from mha_onnx.graph.expressions import evaluate, is_expression
from mha_onnx.graph.images import pin_dims
from mha_onnx.graph.roles import integer_roles
from mha_onnx.graph.walk import all_nodes

NP_TYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
}
COUNT_FROM = 3  # the first of positions counting up (ShapeCase.counted)
# Dim names exporters give the batch axis; every other symbolic dim is a length.
_BATCH_DIM = re.compile(r"batch|^b$|^n$", re.IGNORECASE)
# Ops that pass an input's values on unchanged (as far as "is it a mask" goes).

@dataclass(frozen=True)
class InputSpec:
    """One model input. ``role``: "data" (floats), "mask" (bool or 0/1: which keys take
    part), "ids" (integer indices below ``bound``)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]
    role: str = "data"
    bound: int = 16
    # symbolic dims below whose size the graph does not run (a convolution stack's receptive
    # field over raw audio samples): ((dim, least size), ...), found by graphdims.floor_dims
    floors: tuple[tuple[str, int], ...] = ()
    # the dims as the file declares them where ``dims`` made some concrete (an image's size,
    # images.pin_dims): what a given input is checked against
    declared: tuple[int | str | None, ...] | None = None


@dataclass(frozen=True)
class ShapeCase:
    """Values for the symbolic dims and the padding to use in mask inputs: "none", "some"
    (every row keeps >= 1 key; right padding, holes, all but one), "left" (row b's first
    (b % 4) quarters padded, >= 1 key kept), "full" (the last batch
    entry fully padded), "tail" (the last ``pad_fraction`` of keys of every row), "front"
    (the first ``pad_fraction`` of keys of every row).
    ``optional``: sizes the model itself may refuse (past a length threshold, where a position
    table may end): skipped, and said so, when the original cannot run them."""

    label: str
    dims: dict[str, int]
    padding: str = "some"
    pad_fraction: float = 0.0
    optional: bool = False
    counted: tuple[str, ...] = ()  # integer inputs [B, S] given as positions counting up

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.label} ({inner})" if inner else self.label


def is_batch_dim(name: str) -> bool:
    return bool(_BATCH_DIM.search(name))


# -- what each input is ---------------------------------------------------------------------------

def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (initializers listed as inputs excluded), with their roles."""
    return floor_dims(model, relate_dims(model, pin_dims(model, _declared(model))))


def _declared(model: onnx.ModelProto) -> list[InputSpec]:
    initializers = {t.name for t in model.graph.initializer}
    roles = integer_roles(model)
    switches = {n.input[0] for n in all_nodes(model.graph) if n.op_type == "If"}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or tensor.elem_type not in NP_TYPES:
            raise InputSpecError(f"input {value.name!r} has a type mha-onnx cannot generate data for")
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in tensor.shape.dim)
        dtype = np.dtype(NP_TYPES[tensor.elem_type])
        role, bound = ("mask", 2) if dtype == np.bool_ else ("data", 16)
        if value.name in switches:
            role, bound = "switch", 2
        if dtype.kind in "iu":
            role, bound = roles.get(value.name, ("ids", 16))
        specs.append(InputSpec(value.name, dtype, dims, role, bound))
    return specs


def contract_specs(config) -> list[InputSpec]:
    """The input specs of an mha-onnx export of ``config`` (no model needed)."""
    from mha_onnx.config import graph_inputs

    return [InputSpec(t.name, np.dtype(t.dtype), tuple(t.dims),
                      "mask" if t.dtype == "bool" else "data", 2 if t.dtype == "bool" else 16)
            for t in graph_inputs(config)]


def symbolic_dims(specs: Sequence[InputSpec]) -> list[str]:
    """The free symbolic dims of the inputs (expressions of them, e.g. ``a + b``, left out)."""
    seen: dict[str, None] = {}
    for spec in specs:
        for dim in spec.dims:
            if isinstance(dim, str) and not is_expression(dim):
                seen.setdefault(dim)
    return list(seen)


def split_dims(specs: Sequence[InputSpec]) -> tuple[list[str], list[str]]:
    """(batch dims, length dims) of the inputs' symbolic dims, lengths in order of
    appearance (query length first, then key/value length). Batch dims go by their name; a
    model whose dims have none of the usual names (torch's ``s0``, ``s1``) has as batch the
    dim that leads every input of rank >= 2."""
    names = symbolic_dims(specs)
    batch = [n for n in names if is_batch_dim(n)]
    if not batch:
        leading = {spec.dims[0] for spec in specs if len(spec.dims) >= 2}
        if len(leading) == 1 and isinstance(next(iter(leading)), str):
            batch = [next(iter(leading))]
    return batch, [n for n in names if n not in batch]


# -- shape cases ---------------------------------------------------------------------------------

def case_for(specs: Sequence[InputSpec], label: str, batch: int, lengths: Sequence[int],
             padding: str = "some", pad_fraction: float = 0.0, *, lift: bool = True
             ) -> ShapeCase:
    """A case with ``batch`` on batch dims and ``lengths`` on the length dims in order (the
    last length repeats for further dims); a length below its dim's floor is lifted by it
    (distinct lengths stay distinct)."""
    batch_names, seq_names = split_dims(specs)
    floors = dim_floors(specs) if lift else {}
    dims = dict.fromkeys(batch_names, batch)
    for n, name in enumerate(seq_names):
        dims[name] = lifted(lengths[min(n, len(lengths) - 1)], floors.get(name, 1))
    return ShapeCase(label, dims, padding, pad_fraction)


def default_cases(specs: Sequence[InputSpec], *, max_len: int = 64) -> list[ShapeCase]:
    """Cases that vary every dynamic dim: all ones, distinct odd sizes, a larger one with a
    fully padded batch entry. Batch dims stay small."""
    odd = [13, 7, 19, 5, 23, 11]
    larger = [min(max_len, v) for v in (40, 64, 33, 57, 24, 48)]
    floors = dim_floors(specs)
    ones = {n: floors.get(n, 1) for n in symbolic_dims(specs)}
    return [ShapeCase("ones", ones, padding="none"),
            case_for(specs, "odd", 2, odd, "some"),
            case_for(specs, "longer", 3, larger, "full")]


def parse_shapes(text: str, specs: Sequence[InputSpec]) -> list[ShapeCase]:
    """``B:S[:T],...`` -> cases. B goes to batch dims, S to the first length dim, T to the
    second (key/value length) if the model has one."""
    _, seq_names = split_dims(specs)
    cases = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise InputSpecError(
                f"malformed shape {item!r} in --shapes",
                hint="use B:S or B:S:T with positive integers, e.g. --shapes 1:128,4:77:33")
        values = [int(f) for f in fields]
        if len(values) == 3 and len(seq_names) < 2:
            raise InputSpecError(f"shape {item!r} gives a key length but the model has one "
                                 "sequence dim", hint="use B:S for self-attention models")
        case = case_for(specs, item, values[0], values[1:], "some", lift=False)
        below = [f"{n} >= {f}" for n, f in dim_floors(specs).items() if case.dims.get(n, f) < f]
        if below:
            raise InputSpecError(f"shape {item!r} is below the least sizes the model runs at "
                                 f"({', '.join(below)}: its convolutions need them)",
                                 hint="use larger shapes in --shapes")
        cases.append(case)
    if not cases:
        raise InputSpecError("--shapes is empty", hint="e.g. --shapes 1:128,4:77:33")
    return cases


# -- values --------------------------------------------------------------------------------------

def padding_pattern(batch: int, length: int, case: ShapeCase, rng: np.random.Generator) -> np.ndarray:
    """bool [batch, length], True = padded, as ``case.padding`` says."""
    padded = np.zeros((batch, length), dtype=bool)
    if case.padding == "tail":
        padded[:, length - int(round(length * case.pad_fraction)):] = True
        return padded
    if case.padding == "front":  # a prompt left-padded, run on in later chunks
        padded[:, :int(round(length * case.pad_fraction))] = True
        return padded
    if case.padding == "none":
        return padded
    if case.padding == "left":  # a batched prompt as generation pads it: row b loses b/4
        for b in range(batch):
            padded[b, :min(length - 1, (b % 4) * length // 4)] = True
        return padded
    for b in range(batch):
        kind = b % 3
        if kind == 1:  # right padding
            padded[b, max(1, (3 * length) // 4):] = True
        elif kind == 2:  # all but one key padded
            padded[b, :] = True
            padded[b, int(rng.integers(0, length))] = False
        elif b > 0:  # holes
            padded[b, rng.random(length) < 0.3] = True
            padded[b, 0] = False
    if case.padding == "full" and batch > 1:
        padded[batch - 1] = True
    return padded


def kept_at_least(padded: np.ndarray, least: int, case: ShapeCase) -> np.ndarray:
    """``padded`` (bool [batch, length]) with every row keeping ``least`` (> 1) keys or
    more: a row below it keeps its first ``least`` (its last under left padding). A mask
    over a dim with a floor (a convolution stack's raw samples: each row's kept count
    becomes its frames) is nonsense below it: the model computes a negative length."""
    least = min(least, padded.shape[1])
    if least <= 1:  # (no floor: a fully padded row is a case of its own)
        return padded
    for row in padded:
        if (~row).sum() < least:
            (row[row.size - least:] if case.padding == "left" else row[:least])[...] = False
    return padded


def _mask_values(spec: InputSpec, shape: tuple[int, ...], case: ShapeCase,
                 rng: np.random.Generator, least: int = 1) -> np.ndarray:
    """bool masks: True = padded (PyTorch); integer masks: 1 = keep (Hugging Face);
    ``least``: the keys each row keeps at least (kept_at_least)."""
    if len(shape) < 2:
        padded = np.zeros(shape, dtype=bool)
    else:
        flat = kept_at_least(padding_pattern(shape[0], shape[-1], case, rng), least, case)
        padded = np.broadcast_to(flat.reshape(shape[0], *([1] * (len(shape) - 2)), shape[-1]),
                                 shape).copy()
    return padded if spec.dtype == np.bool_ else (~padded).astype(spec.dtype)


def make_inputs(specs: Sequence[InputSpec], case: ShapeCase, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``case``: masks with its padding (each row keeping at least its
    dim's floor), ids below their bound, floats from a standard normal."""
    rng = np.random.default_rng(seed)
    floors = dim_floors(specs)
    feeds = {}
    for spec in specs:
        shape = tuple(_size(d, case.dims) for d in spec.dims)
        if spec.role == "mask":
            least = floors.get(spec.dims[-1], 1) if spec.dims else 1
            feeds[spec.name] = _mask_values(spec, shape, case, rng, least)
        elif spec.name in case.counted and len(shape) == 2:  # a generation loop's positions
            feeds[spec.name] = np.broadcast_to(COUNT_FROM + np.arange(shape[1]), shape
                                               ).astype(spec.dtype)
        elif spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, spec.bound, size=shape).astype(spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return feeds


def _size(dim: int | str | None, values: dict[str, int]) -> int:
    """A concrete size for ``dim``: given, resolved from an expression, else 4."""
    if isinstance(dim, str) and dim in values:
        return values[dim]
    resolved = evaluate(dim, values)
    return 4 if resolved is None else resolved


def iter_feeds(specs: Sequence[InputSpec], cases: Sequence[ShapeCase], *,
               seed: int = 0) -> Iterator[tuple[ShapeCase, dict[str, np.ndarray]]]:
    """Each case's inputs; a model with switches (bool inputs an If branches on, such as
    Optimum's ``use_cache_branch``) gets every case with each switch on and off."""
    switches = [s for s in specs if s.role == "switch"]
    for n, case in enumerate(cases):
        feeds = make_inputs(specs, case, seed=seed + n)
        if not switches:
            yield case, feeds
            continue
        for on in (True, False):
            values = {s.name: np.full(feeds[s.name].shape, on, dtype=s.dtype) for s in switches}
            label = f"{case.label}, {', '.join(s.name for s in switches)}={on}"
            yield replace(case, label=label), {**feeds, **values}


def load_inputs(path: str | Path, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """User inputs from an ``.npz`` (one array per input name), checked against the model."""
    try:
        with np.load(path, allow_pickle=False) as data:
            feeds = {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise InputSpecError(f"cannot read inputs from {path}: {exc}",
                             hint="save them with numpy.savez(path, name=array, ...)") from exc
    return load_feeds(feeds, specs, str(path))


def load_feeds(feeds: dict[str, np.ndarray], specs: Sequence[InputSpec],
               path: str = "the given inputs") -> dict[str, np.ndarray]:
    """Given arrays checked against the model's inputs (names, ranks, static dims), cast to
    the input types."""
    missing = [s.name for s in specs if s.name not in feeds]
    if missing:
        raise InputSpecError(f"{path} lacks input(s) {', '.join(missing)}",
                             hint=f"it holds {', '.join(sorted(feeds)) or 'nothing'}")
    out = {}
    for spec in specs:
        array = feeds[spec.name]
        wanted = spec.declared if spec.declared is not None else spec.dims
        if array.ndim != len(wanted) or any(isinstance(d, int) and d != n
                                            for d, n in zip(wanted, array.shape, strict=False)):
            raise InputSpecError(f"input {spec.name} in {path} has shape {list(array.shape)}; "
                                 f"the model wants {list(wanted)}")
        out[spec.name] = array.astype(spec.dtype, copy=False)
    return out


def case_of_feeds(specs: Sequence[InputSpec], feeds: dict[str, np.ndarray], label: str) -> ShapeCase:
    """The case (symbolic dim values) that given feeds make."""
    dims: dict[str, int] = {}
    for spec in specs:
        for dim, n in zip(spec.dims, feeds[spec.name].shape, strict=False):
            if isinstance(dim, str):
                dims.setdefault(dim, int(n))
    return ShapeCase(label, dims, padding="given")
