"""The ``validate`` run: parity of a model across PyTorch, ORT CPU, CUDA and TensorRT.

References: the PyTorch reference rebuilt from an mha-onnx export's metadata and weights, and/or
another ONNX model (``--reference``, e.g. the unfused original) on ORT CPU. Every requested
provider runs every shape case; statistics per output x provider x shape x reference. Fully
masked rows (every key padded) are reported apart with each runtime's behaviour; any other
NaN/Inf fails. A provider that cannot run is reported with ORT's reason, never replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mha_onnx.graph import cache, metadata
from mha_onnx.graph.files import prepare_output, read_model
from mha_onnx.graph.inputs import (
    InputSpec,
    ShapeCase,
    case_for,
    case_of_feeds,
    load_feeds,
    load_inputs,
    make_inputs,
)
from mha_onnx.graph.metadata import session_options
from mha_onnx.graph.preflight import preflight
from mha_onnx.graph.roles import length_limit
from mha_onnx.graph.trials import weights_at
from mha_onnx.parity.bisect import after_failure
from mha_onnx.parity.config import ValidateConfig
from mha_onnx.parity.decode import PROMPT, blank_padded, decode_chains, has_padding_mask
from mha_onnx.parity.golden import (
    GoldenReference,
    GoldenRun,
    file_sha256,
    golden_coverage,
    load_golden,
    save_golden,
)
from mha_onnx.parity.held import held_note, hold_routes, routed_source
from mha_onnx.parity.kernels import attention_kernels, describe
from mha_onnx.parity.references import model_to_validate, with_golden
from mha_onnx.parity.report import Comparison, MaskedRows, ProviderStatus, ValidationReport
from mha_onnx.profile.memory import ensure_fits
from mha_onnx.runtime import capabilities, make_runner
from mha_onnx.runtime.machine import machine_info
from mha_onnx.runtime.ort import OrtRunner, ProviderError, node_placement
from mha_onnx.stats import compare

log = logging.getLogger(__name__)


def validation_cases(specs: Sequence[InputSpec], positions: int | None = None
                     ) -> list[ShapeCase]:
    """The default sweep: seq 1, odd lengths, powers of two, seq_q != seq_kv, batch 1 and > 1;
    padding patterns include all-but-one key masked and a fully masked batch entry.
    ``positions``: a position table's size (a model with learned positions), which no two
    lengths together may pass."""
    cap = (lambda n: min(n, positions // 2)) if positions else (lambda n: n)  # noqa: E731
    return [
        case_for(specs, "seq 1", 1, [1], "none"),
        case_for(specs, "odd", 1, [7, 5], "some"),
        case_for(specs, "pow2", 2, [cap(16), cap(32)], "some"),
        case_for(specs, "odd, padded", 3, [cap(33), cap(17)], "full"),
        case_for(specs, "pow2, long", 2, [cap(128), cap(64)], "full"),
    ]


def _fully_masked(specs: Sequence[InputSpec], feeds: Mapping[str, np.ndarray]) -> tuple[str, list[int]] | None:
    """(batch dim name, batch indices) whose mask input marks every key masked."""
    for spec in specs:
        array = feeds[spec.name]
        if spec.role != "mask" or array.ndim < 2 or not isinstance(spec.dims[0], str):
            continue  # [B, T], or [B, 1, T] / [B, 1, S, T]: every key of every query
        padded = array if spec.dtype == np.bool_ else array == 0
        rows = [b for b in range(array.shape[0]) if padded[b].all()]
        if rows:
            return spec.dims[0], rows
    return None


def _behaviour(values: np.ndarray) -> str:
    if np.isnan(values).all():
        return "NaN"
    if np.isnan(values).any():
        return "partly NaN"
    if not np.isfinite(values).all():
        return "Inf"
    return "zeros" if not values.any() else "finite"


def _cast_feeds(feeds: Mapping[str, np.ndarray], specs: Sequence[InputSpec] | None) -> dict[str, np.ndarray]:
    if specs is None:
        return dict(feeds)
    by_name = {s.name: s for s in specs}
    return {k: v.astype(by_name[k].dtype) if k in by_name else v for k, v in feeds.items()}


def _runs(specs: Sequence[InputSpec], config: ValidateConfig, positions: int | None = None
          ) -> tuple[list[tuple[ShapeCase, dict[str, np.ndarray]]], GoldenReference | None]:
    """What to feed: a golden file's stored inputs, the user's inputs, or generated cases."""
    if config.load_outputs:
        stored, meta = load_golden(config.load_outputs)
        runs = [(ShapeCase(r.case, {}, "given"), load_feeds(r.inputs, specs)) for r in stored]
        return runs, GoldenReference(stored, meta, config.load_outputs)
    if config.inputs:
        feeds = load_inputs(config.inputs, specs)
        return [(case_of_feeds(specs, feeds, f"inputs from {config.inputs}"), feeds)], None
    cases = list(config.shapes) if config.shapes else validation_cases(specs, positions)
    return [(case, make_inputs(specs, case, seed=config.seed + n))
            for n, case in enumerate(cases)], None


def _position_table(model, config: ValidateConfig) -> int | None:
    """The rows of the position table no run may pass: export --model's record of it, else
    the smallest table the model or its --reference gathers from by length (a BERT-like
    file made elsewhere: its learned positions stop there, and a longer run fails in ORT)."""
    hf = metadata.loaded(model, "hf_model") or {}
    if hf.get("positions"):
        return hf["positions"]
    found = [length_limit(m) for m in
             (model, read_model(config.reference) if config.reference else None) if m]
    return min((n for n in found if n), default=None)


def validate_model(path: str | Path, config: ValidateConfig) -> ValidationReport:
    """Compare ``path`` on every requested provider against the available references."""
    started = time.perf_counter()
    if config.save_outputs:
        prepare_output(config.save_outputs, force=config.force)
    model = model_to_validate(path, config)
    if "quantization" in metadata.read(model):  # accuracy against its float original
        from mha_onnx.parity.quantized import validate_quantized
        config.progress("a quantized model: its accuracy against its float original")
        return validate_quantized(path, config)
    with weights_at(Path(path).resolve().parent):  # (trial runs of a model read without them)
        return _validated(path, model, config, started)


def _validated(path: str | Path, model, config: ValidateConfig, started: float
               ) -> ValidationReport:
    shared = cache.is_shared(model)  # then fed and compared through the appended interface
    specs, pairs = cache.shared_view(model)
    runs, golden = _runs(specs, config, _position_table(model, config))
    if config.memory_check:  # the model, PyTorch and the reference run at once
        ensure_fits(model, [c for c, _ in runs], copies=3,
                    hint="use smaller --shapes or pass --no-memory-check")
    references, labels, checks, ref_specs = with_golden(model, path, config, golden)
    if not references:  # --ranges alone (references.py): nothing to compare, no run to make
        from mha_onnx.parity.ranges import ranges_alone

        return ranges_alone(path, config, _looked_into(path, model, config, [], runs, [], {})[1],
                            started)
    config.progress(f"{len(runs)} input shapes on {', '.join(config.providers)} against "
                    f"{', '.join(labels) or 'nothing'}")
    level = session_options(model).get("optimization", "all")
    rows = cache.row_layout(model)  # per-row lengths: buffers hold each row's kept keys first
    probe = cache.to_shared(runs[0][1], specs, pairs, rows=rows,
                            length_input=cache.takes_length(model)) if shared else runs[0][1]
    routers, source = routed_source(model, references)  # (held.py)
    runners, statuses = _start_providers(str(path), config, probe, level, source)
    if shared:
        steps = PROMPT + config.decode_steps + 1
        runners = {p: cache.SharedCache(r, specs, pairs, steps, rows=rows)
                   for p, r in runners.items()}
    held = hold_routes(runners, references, routers, [o.name for o in model.graph.output])
    try:
        comparisons, masked, saved = _compare_runs(model, specs, runs, references, ref_specs,
                                                   runners, config, set(pairs.values()))
        probes: list[tuple[str, dict]] = []
        if pairs and golden is None and not config.inputs and config.decode_steps > 0:
            config.progress(f"decode chains ({config.decode_steps} steps)")
            decoded, probes = _decode(model, specs, pairs, references, runners, config)
            comparisons += decoded
    finally:
        for runner in runners.values():
            runner.close()
    rows, shared = cache.row_layout(model), cache.is_shared(model)  # (runners closed first)
    kernels = [f"{step}: {describe(attention_kernels(str(path), feeds, specs, pairs, shared, rows))}"
               for step, feeds in probes]
    if config.save_outputs and saved:
        _save_outputs(path, config, saved, next(iter(runners)))
    if golden is not None:  # a comparison of nothing is no pass
        checks.append(golden_coverage(golden, model, comparisons))
    bisected, ranges = _looked_into(path, model, config, comparisons, runs, statuses,
                                    ref_specs)
    return ValidationReport(
        model=str(path), references=tuple(labels), providers=tuple(statuses),
        comparisons=tuple(comparisons), masked_rows=tuple(masked), checks=tuple(checks),
        allow_missing=config.allow_missing, seconds=time.perf_counter() - started,
        notes=tuple([*placement_notes(model, statuses), *held_note(held, runners)]),
        bisect=bisected, decode_kernels=tuple(kernels), ranges=ranges,
    )


def _looked_into(path, model, config: ValidateConfig, comparisons, runs, statuses, ref_specs):
    """What --bisect (the first mismatch's node) and --ranges (activations against float16's
    range) found; None for what was not asked."""
    bisected = ranges = None
    if config.bisect and any(not c.stats.passed for c in comparisons):
        config.progress("bisecting the first mismatch")
        bisected = after_failure(str(path), config, comparisons, runs,
                                 [s.provider for s in statuses if s.ran],
                                 lambda feeds: _cast_feeds(feeds, ref_specs))
    if config.ranges:
        from mha_onnx.parity.ranges import activation_ranges

        config.progress("activation ranges (every value of the graph exposed)")
        ranges = activation_ranges(str(path), model, [f for _, f in runs[:3]],
                                   chunk=config.bisect_chunk, threads=config.threads)
    return bisected, ranges


def _save_outputs(path, config: ValidateConfig, saved, provider: str) -> None:
    save_golden(config.save_outputs, saved, {
        "model": Path(path).name, "model_sha256": file_sha256(path), "provider": provider,
        "machine": machine_info()}, force=config.force)


ATTENTION_KERNELS = ("(MultiHeadAttention)", "(GroupQueryAttention)", "(Attention)")


def placement_notes(model, statuses: Sequence[ProviderStatus]) -> list[str]:
    """Warnings a GPU deployment needs: attention kernels ORT runs on the CPU under another
    provider (ORT's CUDA GroupQueryAttention has no float32 kernel, for one), and a model
    fused with the forms of another execution provider than the one validated."""
    notes = []
    fusion = metadata.loaded(model, "fusion") or {}
    fused_for = fusion.get("ep", "cpu") if fusion.get("target", "ort") == "ort" else None
    for status in statuses:
        if not status.ran or not capabilities(status.provider).places_nodes_on_cpu:
            continue
        kernels = [n for n in status.cpu_nodes if n.endswith(ATTENTION_KERNELS)]
        if kernels:
            notes.append(f"under {status.provider}, ORT runs {len(kernels)} attention kernel(s) "
                         f"on the CPU: {', '.join(kernels[:6])}"
                         + (" ..." if len(kernels) > 6 else ""))
        if fused_for is not None and fusion.get("blocks") and fused_for != status.provider:
            notes.append(f"the model was fused with the forms for {fused_for}; "
                         f"`mha-onnx fuse --ep {status.provider}` picks those measured on "
                         f"{status.provider}")
    return notes


def _decode(model, specs, pairs, references, runners, config: ValidateConfig
            ) -> tuple[list[Comparison], list[tuple[str, dict]]]:
    """A prompt and ``decode_steps`` single-token steps, every runtime on its own chain; and
    the feeds of the prompt, the first and the last step on ORT CPU (whose attention
    kernels the report says)."""
    out_dims = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
                for o in model.graph.output}
    runtimes = {**runners, **{f"reference:{k}": r for k, r in references.items()}}
    # (the runners first: a reference holding routes takes them from the step just run)
    comparisons: list[Comparison] = []
    chains = [("decode ", True)]  # left-padded rows, as batched generation pads prompts
    if has_padding_mask(specs):  # and the branch a batch without padding takes
        chains.append(("decode (no key padded) ", False))
    probes: list[tuple[str, dict]] = []  # (step, its feeds on ORT CPU): kernels said
    for prefix, padded in chains:
        steps = decode_chains(runtimes, specs, pairs, config.decode_steps, seed=config.seed,
                              padded=padded)
        if "cpu" in runners:
            probes += _probe_feeds(prefix, steps, pairs)
        for label, results, fresh in steps:
            results = {k: blank_padded(v, fresh, specs, out_dims, set(pairs.values()))
                       for k, v in results.items()}
            wants = {k.split(":", 1)[1]: v for k, v in results.items()
                     if k.startswith("reference:")}
            gots = {k: v for k, v in results.items() if not k.startswith("reference:")}
            case = ShapeCase(f"{prefix}{label}", {}, "given")
            comparisons += _compare_case(case, gots, wants, None, out_dims, config)
    return comparisons, probes


def _probe_feeds(prefix: str, steps, pairs) -> list[tuple[str, dict]]:
    """The prompt, the first and the last step of a chain as ORT CPU ran them (its pasts:
    the presents it returned the step before)."""
    out, previous = [], None
    picked = {0, 1, len(steps) - 1}
    for n, (label, results, fresh) in enumerate(steps):
        feeds = dict(fresh)
        if previous is not None:
            feeds.update({past: previous[present] for past, present in pairs.items()})
        if n in picked:
            out.append((f"{prefix}{label}", feeds))
        previous = results["cpu"]
    return out


def _compare_runs(model, specs, runs, references, ref_specs, runners, config: ValidateConfig,
                  presents: set[str]):
    """Every run on every provider against every reference; the first provider's outputs
    are kept for a golden file. A KV-cache decoder's (``presents``: its present outputs)
    positions that its mask pads are left out (decode.blank_padded), as in its decode chains."""
    out_dims = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
                for o in model.graph.output}
    comparisons: list[Comparison] = []
    masked: list[MaskedRows] = []
    saved: list[GoldenRun] = []
    for number, (case, feeds) in enumerate(runs, 1):
        config.progress(f"shape {number}/{len(runs)}: {case.describe()}")
        gots = {p: r.infer(feeds) for p, r in runners.items()}  # (first: held.py)
        wants = {key: ref.infer(_cast_feeds(feeds, ref_specs) if key == "reference" else feeds)
                 for key, ref in references.items()}
        special = _fully_masked(specs, feeds)
        if special is not None:
            masked += _masked_rows(case, gots, wants, special, out_dims)
        if gots:
            saved.append(GoldenRun(case.describe(), feeds, next(iter(gots.values()))))
        if presents:
            gots, wants = ({k: blank_padded(v, feeds, specs, out_dims, presents)
                            for k, v in outs.items()} for outs in (gots, wants))
        comparisons += _compare_case(case, gots, wants, special, out_dims, config)
    return comparisons, masked, saved


def _start_providers(path: str, config: ValidateConfig, probe_feeds: dict[str, np.ndarray],
                     level: str, source: bytes | None = None):
    """A runner per provider that starts; a status per provider (ORT's reason when it does
    not, or the crash a child process saw; the nodes ORT put on the CPU under another
    provider when it does). ``level``: the optimisation level the model needs; ``source``:
    the first provider's model (the file with its routers' indices as outputs: held.py)."""
    statuses: list[ProviderStatus] = []
    runners: dict[str, OrtRunner] = {}
    for provider in config.providers:
        ort = capabilities(provider).child_preflight  # ORT meets the model in a child first
        checked = preflight(path, provider, level) if ort else None
        if checked is not None and checked.crashed:
            statuses.append(ProviderStatus(provider, False, checked.message()))
            continue
        model = source if source is not None and not runners else path
        runner = make_runner(model, provider, threads=config.threads,
                             io_binding=provider != "cpu", strict=False, optimization=level)
        try:
            runner.session  # noqa: B018
        except ProviderError as exc:
            hint = f" (hint: {exc.hint})" if exc.hint else ""
            statuses.append(ProviderStatus(provider, False, str(exc) + hint))
            continue
        cpu_nodes: tuple[str, ...] = ()
        if provider != "cpu" and ort:
            placement = node_placement(path, provider, probe_feeds)
            cpu_nodes = tuple(sorted(f"{name} ({op})" for name, (op, where) in placement.items()
                                     if where == "cpu"))
        runners[provider] = runner
        runtime = "" if ort else runner.info.providers_in_session[0]
        statuses.append(ProviderStatus(provider, True, cpu_nodes=cpu_nodes, runtime=runtime,
                                       io_binding=runner.io_binding))
    return runners, statuses


# References that run the original's own graph: where every key of a row is masked, the file
# must give what they give (fuse keeps the original's value there); PyTorch's kernels differ
# among themselves there (NaN, zeros or the mean of V), so against it those rows are only shown.
MASKED_ROWS_COMPARED = ("reference", "golden")


def _compare_case(case: ShapeCase, gots, wants, special, out_dims, config: ValidateConfig) -> list[Comparison]:
    """Statistics per output x provider x reference; fully masked batch entries left out
    against PyTorch only (MASKED_ROWS_COMPARED)."""
    out = []
    for provider, got in gots.items():
        for output, actual in got.items():
            for key, want in wants.items():
                if output not in want:
                    continue
                a, e = actual, want[output]
                if special is not None and special[0] in out_dims.get(output, []) \
                        and key not in MASKED_ROWS_COMPARED:
                    axis = out_dims[output].index(special[0])
                    keep = [b for b in range(actual.shape[axis]) if b not in special[1]]
                    a, e = np.take(actual, keep, axis=axis), np.take(e, keep, axis=axis)
                atol, rtol = config.tolerance_for(output, actual.dtype, provider)
                out.append(Comparison(output, provider, key, case.describe(),
                                      compare(a, e, atol=atol, rtol=rtol)))
    return out


def _masked_rows(case: ShapeCase, gots, wants, special, out_dims) -> list[MaskedRows]:
    """What each runtime gives for the batch entries whose keys are all masked."""
    out = []
    batch_dim, rows = special
    for name, dims_ in out_dims.items():
        if batch_dim not in dims_:
            continue
        axis = dims_.index(batch_dim)
        seen = {key: _behaviour(np.take(want[name], rows, axis=axis))
                for key, want in wants.items() if name in want}
        for provider, got in gots.items():
            seen[capabilities(provider).label] = _behaviour(np.take(got[name], rows, axis=axis))
        compared = tuple(key for key, want in wants.items()
                         if key in MASKED_ROWS_COMPARED and name in want)
        out.append(MaskedRows(case.describe(), name, f"batch entries {rows}", seen, compared))
    return out
