"""Rotary embeddings folded into GroupQueryAttention (``do_rotary``), proven by evaluation.

A decoder's Q and K reach a fused GroupQueryAttention as ``[B, S, H*D]`` after the exporter
split their heads, rotated them (``x * cos + rotate_half(x) * sin``, Hugging Face's spelling,
about seven ops each) and our lowering joined the heads again: a dozen small kernels per
tensor per layer on every decode step. GroupQueryAttention rotates Q and K itself from
``cos_cache`` / ``sin_cache`` tables ``[positions, D/2]`` and the ``position_ids`` input, as
ORT GenAI's graphs do. The tables are not guessed from a config: the graph's own cos/sin
values are cut out and run (slices.SliceRunner) with positions ``0 .. MAX_POSITIONS - 1``,
and accepted only if they are a function of the positions alone (one integer input), equal
in both halves (``rotate_half``'s layout; twice in a row for the interleaved rotation, then
``rotary_interleaved``) and equal, at random positions in a batch, to the
table rows of those positions.

GroupQueryAttention (onnxruntime 1.31, CPU) reads ``position_ids`` row by row for a one-token
step, but a prompt's positions as the first row's first position counted up. So the rotating
kernel runs behind ``If`` (one new token, or every row counted up from the first position;
every position inside the tables, and the total length too: ORT refuses a cos_cache shorter
than total_sequence_length), else the block's GroupQueryAttention as lowered, reading the
exporter's rotation; the nodes only that branch reads can then move into it (into_branches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mha_onnx.rewrite.irutil import BLOCK, MS_DOMAIN, STEP, insert_first, int_attr, opset
from mha_onnx.rewrite.recognise.slices import Refused, SliceRunner, input_symbols
from mha_onnx.rewrite.tighten.packing import pack, projections, split_source
from mha_onnx.rewrite.tighten.rotary_match import Rotated, joined, rotated, unsplit

MAX_POSITIONS = 8192  # rows of the cos/sin tables; later positions take the exporter's rotation
MIN_POSITIONS = 64  # a table shorter than this is not worth a kernel of its own
_CHECK_BATCH, _CHECK_SEQ = 3, 5  # random positions the tables are checked at


@dataclass(frozen=True)
class Folded:
    """What fold_rotary changed: {block: positions input}, the blocks whose kernel also
    runs prompts, and the values its guards read (``positions``) and are (``guards``), for
    sink_into_branches' choice of what to copy."""

    blocks: dict[str, str]
    prompts: frozenset[str] = frozenset()  # blocks whose kernel for prompts was folded
    steps: frozenset[str] = frozenset()  # blocks whose kernel for one-token steps was
    positions: tuple[ir.Value, ...] = ()
    guards: tuple[ir.Value, ...] = ()
    packed: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # packing.pack
    rows: tuple[int, ...] = ()  # the positions each distinct pair of tables holds

    def copyable(self, graph: ir.Graph):
        """Predicate: a node of ``graph`` computed from the positions inputs and constants
        alone (the rotation's cos/sin, as big as the positions): copied into each layer's
        branch. Not the guards (from their last node up), which every layer reads."""
        sources = {id(v) for v in self.positions}
        guarding = {id(v.producer()) for v in self.guards}
        only: set[int] = set()
        for node in graph:
            if id(node) not in guarding and all(
                    v is None or id(v) in sources or v.is_initializer()
                    or v.const_value is not None
                    or (v.producer() is not None and id(v.producer()) in only)
                    for v in node.inputs):
                only.add(id(node))
        return lambda node: id(node) in only


@dataclass(frozen=True)
class _Tables:
    cos: ir.Value  # [MAX_POSITIONS, D/2] initializers
    sin: ir.Value
    positions: ir.Value  # the graph input the rotation reads
    interleaved: bool = False  # each value twice in a row (the pairs' layout), not two halves


def fold_rotary(model: ir.Model, max_positions: int = MAX_POSITIONS) -> Folded:
    """Every GroupQueryAttention whose Q and K arrive rotated by the exporter rotates them
    itself where that is exact (guarded, see the module doc). The exporter's rotation stays
    in the main graph: sink_into_branches(graph, folded.copyable(graph)) moves it into the
    branches that read it, once nothing outside them does."""
    graph = model.graph
    if opset(model) < 13:
        return Folded({})
    tables: dict[tuple[int, int], _Tables | None] = {}
    guards: dict[tuple[int, bool, int], ir.Value] = {}
    folded: dict[str, str] = {}
    prompted: set[str] = set()
    stepped: set[str] = set()
    packed: dict[str, tuple[str, int, int]] = {}

    def table(found: Rotated) -> _Tables | None:
        key = (id(found.cos), id(found.sin), found.interleaved)
        if key not in tables:
            tables[key] = _tables(model, found, max_positions,
                                  [t for t in tables.values() if t is not None])
        return tables[key]

    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if not _candidate(node):
            continue
        q = rotated(node.inputs[0], int_attr(node, "num_heads", 0))
        k = rotated(node.inputs[1], int_attr(node, "kv_num_heads", 0))
        if q is None or k is None or (q.rows is None) != (k.rows is None) \
                or q.interleaved != k.interleaved or q.before_transpose != k.before_transpose:
            continue
        found = table(q)  # Q's and K's cos/sin: one pair of tables (GPT-J computes them twice)
        if found is None or table(k) is not found:
            continue
        prompts = not node.meta.get(STEP, False)  # else its guard admits one-token runs only
        rows = found.cos.shape[0]
        inside_key, key = ((id(found.positions), p, rows) for p in (False, prompts))
        if inside_key not in guards:
            guards[inside_key] = _counted(graph, found.positions, rows)
        if key not in guards:  # (a prompt's: counted up, on top of inside the tables)
            guards[key] = _counted(graph, found.positions, rows, guards[inside_key])
        reads = joined(q), joined(k)
        if q.rows is None:  # (gathered rows: another tensor, left alone)
            _read_shapes_from(node.inputs[0], reads[0])
            _read_shapes_from(node.inputs[1], reads[1])
        inside = guards[inside_key] if prompts else None  # (not counted up: RotaryEmbedding)
        packed.update(_rotate_inside(node, (q, k), reads, found, guards[key], inside))
        block = str(node.meta.get(BLOCK, node.name))
        folded[block] = found.positions.name or ""
        (prompted if prompts else stepped).add(block)
    positions = tuple({id(t.positions): t.positions for t in tables.values() if t}.values())
    rows = sorted({t.cos.shape[0] for t in tables.values() if t is not None})
    return Folded(folded, frozenset(prompted), frozenset(stepped), positions,
                  tuple(guards.values()), packed, tuple(rows))


def _candidate(node: ir.Node) -> bool:
    if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
        return False
    extra = list(node.inputs[7:10])
    return (int_attr(node, "do_rotary", 0) == 0 and len(node.inputs) >= 7
            and node.inputs[1] is not None and all(v is None for v in extra))


def _tables(model: ir.Model, found: Rotated, rows: int, known: list[_Tables]
            ) -> _Tables | None:
    """The cos/sin tables of the graph's own rotation, or None where it is not a lookup by
    one integer positions input [B, S]; one of ``known`` where it holds the same tables (an
    exporter that computes cos/sin once per layer: one pair of initializers, not one per
    layer)."""
    try:
        runner = SliceRunner(model, [found.cos, found.sin], set(input_symbols(model.graph)))
    except Refused:
        return None
    inputs = {v.name: v for v in model.graph.inputs}
    if len(runner.inputs) != 1 or runner.inputs[0][0] not in inputs:
        return None
    name, dtype, shape = runner.inputs[0]
    if dtype != ir.DataType.INT64 or len(shape) != 2:  # the kernel's position_ids: int64
        return None
    rows = _rows_that_run(runner, name, shape, dtype, rows)
    if rows < MIN_POSITIONS:
        return None
    try:
        cos, sin = _at(runner, name, shape, np.arange(rows)[None], dtype)
        rng = np.random.default_rng(0)
        check = rng.integers(0, rows, (_CHECK_BATCH, _CHECK_SEQ))
        cos_at, sin_at = _at(runner, name, shape, check, dtype)
    except Refused:
        return None
    if found.before_transpose:  # [B, S, 1, D] -> [B, 1, S, D]
        cos, sin, cos_at, sin_at = (np.swapaxes(a, 1, 2) if a.ndim == 4 else a
                                    for a in (cos, sin, cos_at, sin_at))
    width = cos.shape[-1] if cos.ndim == 4 else 0
    half = width // 2
    # rotate_half pairs dim i with i + D/2, so each value is in both halves; the interleaved
    # rotation pairs 2i with 2i + 1, so each value is there twice in a row
    first, second = ((slice(0, None, 2), slice(1, None, 2)) if found.interleaved else
                     (slice(0, half), slice(half, None)))
    for table, at in ((cos, cos_at), (sin, sin_at)):
        if (table.shape != (1, 1, rows, width) or at.shape != (_CHECK_BATCH, 1, _CHECK_SEQ, width)
                or not np.array_equal(table[..., first], table[..., second])
                or not np.allclose(at[:, 0], table[0, 0][check], rtol=0, atol=_atol(table))):
            return None
    halves = [np.ascontiguousarray(table[0, 0, :, first]) for table in (cos, sin)]
    for same in known:
        if same.positions is inputs[name] and same.interleaved == found.interleaved and all(
                np.array_equal(have.const_value.numpy(), want)
                for have, want in zip((same.cos, same.sin), halves, strict=True)):
            return same
    graph = model.graph
    made = []
    for label, table, values in (("cos", cos, halves[0]), ("sin", sin, halves[1])):
        value = ir.Value(name=f"rotary_{label}_cache_{len(graph.initializers)}",
                         const_value=ir.tensor(values))
        value.type = ir.TensorType(ir.DataType.from_numpy(table.dtype))
        value.shape = ir.Shape([rows, half])
        graph.register_initializer(value)
        made.append(value)
    return _Tables(made[0], made[1], inputs[name], found.interleaved)


def _rows_that_run(runner: SliceRunner, name: str, shape, dtype: ir.DataType, rows: int
                   ) -> int:
    """The most positions, up to ``rows``, the graph's cos/sin can be computed at (0 if
    none): all of them where the exporter computes cos/sin from the positions (Llama's
    inv_freq), the rows of its table where it looks them up (GPT-J's and CodeGen's
    embed_positions: n_positions rows; ONNX Runtime refuses a Gather past them)."""
    low, high = 0, rows + 1  # low runs (0: nothing tried yet), high does not
    while high - low > 1:
        mid = high - 1 if low == 0 and high == rows + 1 else (low + high) // 2
        try:
            _at(runner, name, shape, np.arange(mid)[None], dtype)
            low = mid
        except Refused:
            high = mid
    return low


def _atol(table: np.ndarray) -> float:
    return 1e-3 if table.dtype == np.float16 else 1e-6


def _at(runner: SliceRunner, name: str, shape, positions: np.ndarray, dtype: ir.DataType
        ) -> tuple[np.ndarray, np.ndarray]:
    sizes = {d: n for d, n in zip(shape, positions.shape, strict=True) if isinstance(d, str)}
    fed = positions.astype(dtype.numpy())
    cos, sin = runner.run(sizes, {name: fed})
    return np.asarray(cos), np.asarray(sin)


def _counted(graph: ir.Graph, positions: ir.Value, rows: int,
             inside: ir.Value | None = None) -> ir.Value:
    """bool: every position inside the tables; given ``inside`` (that bool, for a kernel
    that runs more than one new token): it and one new token or every row counted up from
    the first row's first position (what the kernel assumes of a prompt). Built once per
    positions input and kind, at the top of the graph (after ``inside``)."""
    tape = ir.tape.Tape()

    def const(values) -> ir.Value:
        return tape.op("Constant", [], {"value": ir.tensor(np.array(values, np.int64))})

    pos = positions  # int64 (_tables)
    if inside is None:
        inside = tape.op("And", [
            tape.op("Less", [tape.op("ReduceMax", [pos], {"keepdims": 0}), const(rows)]),
            tape.op("GreaterOrEqual", [tape.op("ReduceMin", [pos], {"keepdims": 0}),
                                       const(0)])])
        return _at_top(graph, tape, inside, f"{positions.name}_inside")
    seq = tape.op("Squeeze", [tape.op("Shape", [pos], {"start": 1, "end": 2}), const([0])])
    first = tape.op("Slice", [pos, const([0, 0]), const([1, 1]), const([0, 1])])
    steps = tape.op("Unsqueeze", [tape.op("Range", [const(0), seq, const(1)]), const([0])])
    counted = tape.op("Equal", [pos, tape.op("Add", [first, steps])])
    every = tape.op("ReduceMin", [tape.op("Cast", [counted], {"to": ir.DataType.INT32})],
                    {"keepdims": 0})
    ok = tape.op("And", [inside, tape.op("Or", [
        tape.op("Equal", [seq, const(1)]),
        tape.op("Equal", [every, tape.op("Constant", [], {"value": ir.tensor(np.int32(1))})]),
    ])])
    ok.name = f"{positions.name}_counted"
    graph.insert_after(inside.producer(), list(tape.nodes))
    return ok


def _at_top(graph: ir.Graph, tape: ir.tape.Tape, value: ir.Value, name: str) -> ir.Value:
    value.name = name
    insert_first(graph, list(tape.nodes))
    return value


def _rotate_inside(node: ir.Node, qk: tuple[Rotated, Rotated],
                   reads: tuple[ir.Value, ir.Value], tables: _Tables, ok: ir.Value,
                   inside: ir.Value | None) -> dict[str, tuple[str, int, int]]:
    """``node`` replaced by If(ok): the same kernel rotating Q and K itself | (a kernel
    that runs prompts: ``inside`` given) If(inside: every position inside the tables) the
    kernel reading Q and K rotated by RotaryEmbedding over the same tables, position by
    position (a left-padded prompt, whose rows the kernel would count up from the first
    row's first position) | ``node`` as it was. The kernel reads ``reads``: Q and K
    unrotated as [B, S, heads*D] (rotation.joined), the projections before their heads were
    split where they were, packed into one tensor where they are three MatMuls of one input
    (packing.py). Rows gathered before the kernel (kept keys first) are read ungathered, the
    branch running only where the gather changes nothing (every row keeps all its keys:
    seqlens_k = total - 1); the kernel rotates a prompt's token s at the first position +
    s, which a reordered row is not. Returns where packed weights went."""
    graph, q = node.graph, qk[0]
    roped = None if inside is None else _roped(node, qk, reads, tables)  # (before packing)
    inputs = list(node.inputs) + [None] * max(0, 10 - len(node.inputs))
    value = unsplit(inputs[2], int_attr(node, "kv_num_heads", 0)) or inputs[2]
    sources = [*reads, value]
    whole, packed = split_source(*sources), {}
    if whole is None and projections(sources) is not None:
        whole, packed = pack(projections(sources))
    inputs[:3] = [whole, None, None] if whole is not None else sources
    ok = _within_tables(ok, inputs[6], tables.cos.shape[0])
    if q.rows is not None:  # rows gathered kept first: the same rows while all are full
        ok = _every_row_full(graph, node, ok)
    inputs[7], inputs[8], inputs[9] = tables.cos, tables.sin, tables.positions
    attributes = [a for name, a in node.attributes.items()
                  if name not in ("do_rotary", "rotary_interleaved")]
    attributes += [ir.AttrInt64("do_rotary", 1),
                   ir.AttrInt64("rotary_interleaved", int(tables.interleaved))]
    rotating = ir.Node(MS_DOMAIN, node.op_type, inputs, attributes,
                       num_outputs=len(node.outputs), name=f"{node.name}_rotating")
    rotating.meta.update(node.meta)
    for new, old in zip(rotating.outputs, node.outputs, strict=True):
        new.name, new.type, new.shape = f"{old.name}_rotating", old.type, old.shape
    fast = ir.Graph([], rotating.outputs, nodes=[rotating], name=f"{node.name}_rotating")
    written = ir.Graph([], [], nodes=[], name=f"{node.name}_as_exported")
    other = written if roped is None else _if_inside(node, inside, roped, written)
    choose = ir.Node("", "If", [ok], [ir.AttrGraph("then_branch", fast),
                                       ir.AttrGraph("else_branch", other)],
                     num_outputs=len(node.outputs), name=f"{node.name}_if_counted")
    graph.insert_before(node, choose)
    for new, old in zip(choose.outputs, node.outputs, strict=True):
        new.name, new.type, new.shape = f"{old.name}_chosen", old.type, old.shape
        if old.is_graph_output():  # the graph keeps its output names
            new.name, old.name = old.name, f"{old.name}_as_exported"
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    graph.remove(node, safe=False)
    written.append(node)
    written.outputs.extend(node.outputs)
    return packed


def _if_inside(node: ir.Node, inside: ir.Value, roped: ir.Graph, written: ir.Graph
               ) -> ir.Graph:
    """A branch of one If(inside): ``roped`` | ``written`` (node's outputs' names suffixed)."""
    inner = ir.Node("", "If", [inside], [ir.AttrGraph("then_branch", roped),
                                         ir.AttrGraph("else_branch", written)],
                    num_outputs=len(node.outputs), name=f"{node.name}_if_inside")
    for new, old in zip(inner.outputs, node.outputs, strict=True):
        new.name, new.type, new.shape = f"{old.name}_inside", old.type, old.shape
    return ir.Graph([], inner.outputs, nodes=[inner], name=f"{node.name}_not_counted")


def _roped(node: ir.Node, qk: tuple[Rotated, Rotated], reads: tuple[ir.Value, ir.Value],
           tables: _Tables) -> ir.Graph:
    """A branch running a copy of ``node`` whose Q and K are ``reads`` rotated by
    RotaryEmbedding (the tables, each token at its own position; rows gathered the way the
    exporter's rotated ones are, where they are)."""
    nodes, kernel_inputs, width = [], list(node.inputs), 2 * tables.cos.shape[1]
    for n, (found, read, heads) in enumerate(zip(qk, reads, (
            int_attr(node, "num_heads", 0), int_attr(node, "kv_num_heads", 0)), strict=True)):
        rope = ir.Node(MS_DOMAIN, "RotaryEmbedding",
                       [read, tables.positions, tables.cos, tables.sin],
                       [ir.AttrInt64("interleaved", int(tables.interleaved)),
                        ir.AttrInt64("num_heads", heads),
                        ir.AttrInt64("rotary_embedding_dim", width)],
                       name=f"{node.name}_rope_{n}")
        rope.outputs[0].type, rope.outputs[0].shape = read.type, read.shape
        rope.outputs[0].name = f"{node.name}_rope_{n}_out"
        nodes.append(rope)
        value = rope.outputs[0]
        if found.rows is not None:  # Gather(Reshape(rotated, [-1, C]), rows) as exported
            flat = found.rows.inputs[0].producer()
            again = ir.Node("", "Reshape", [value, flat.inputs[1]], name=f"{flat.name}_rope")
            gather = ir.Node("", "Gather", [again.outputs[0], found.rows.inputs[1]],
                             [ir.AttrInt64("axis", 0)], name=f"{found.rows.name}_rope")
            nodes += [again, gather]
            again.outputs[0].name = f"{node.name}_rope_{n}_flat"
            value = gather.outputs[0]
            value.name = f"{node.name}_rope_{n}_rows"
        value.type, value.shape = node.inputs[n].type, node.inputs[n].shape
        kernel_inputs[n] = value
    kernel = ir.Node(MS_DOMAIN, node.op_type, kernel_inputs, list(node.attributes.values()),
                     num_outputs=len(node.outputs), name=f"{node.name}_roped")
    kernel.meta.update(node.meta)
    for new, old in zip(kernel.outputs, node.outputs, strict=True):
        new.name, new.type, new.shape = f"{old.name}_roped", old.type, old.shape
    return ir.Graph([], kernel.outputs, nodes=[*nodes, kernel], name=f"{node.name}_roped")


def _within_tables(ok: ir.Value, total: ir.Value, rows: int) -> ir.Value:
    """ok and total_sequence_length <= the tables' rows (onnxruntime 1.31 refuses a cos_cache
    shorter than the total, whatever the positions), computed right after the total."""
    tape = ir.tape.Tape()
    limit = tape.op("Constant", [], {"value": ir.tensor(np.int32(rows))})
    both = tape.op("And", [ok, tape.op("LessOrEqual", [total, limit])])
    after = total.producer() or ok.producer()  # (a graph input: after the positions guard)
    after.graph.insert_after(after, tape.nodes)
    return both


def _every_row_full(graph: ir.Graph, node: ir.Node, ok: ir.Value) -> ir.Value:
    """ok and every row keeping all its keys (min(seqlens_k) = total_sequence_length - 1),
    computed beside ``node``."""
    tape = ir.tape.Tape()
    one = tape.op("Constant", [], {"value": ir.tensor(np.int32(1))})
    least = tape.op("ReduceMin", [node.inputs[5]], {"keepdims": 0})
    full = tape.op("Equal", [least, tape.op("Sub", [node.inputs[6], one])])
    both = tape.op("And", [ok, full])
    graph.insert_before(node, tape.nodes)
    return both


def _read_shapes_from(joined: ir.Value, source: ir.Value) -> None:
    """Shape nodes reading ``joined`` (the rotated heads joined again) read ``source`` (the
    same [B, S, heads*D] before the rotation) instead, so that a guard's length check does
    not keep the rotation running where nothing else needs it."""
    for use in list(joined.uses()):
        if use.node.op_type in ("Shape", "Size") and use.node.domain in ("", "ai.onnx"):
            use.node.replace_input_with(use.idx, source)
