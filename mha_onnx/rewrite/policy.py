"""Every choice fuse makes about forms, in one place: the target, the execution provider, the
kernel form per mask kind, the KV cache's form, and the candidates `fuse --tune` times.

The CLI builds its choices and help from the tables here, ``fuse_model`` and the passes read
the policy (:mod:`mha_onnx.rewrite.passes`), the ONNX Runtime lowerings read its forms
(:mod:`mha_onnx.rewrite.lower.ort`, whose table says which kernel takes which block) and tune
asks it for candidates (:mod:`mha_onnx.tune.run`). A chosen form of one block is
:class:`mha_onnx.rewrite.forms.Form`; this module holds what may be chosen.

Light on purpose (no onnx, no onnx-ir): the CLI imports it to build its options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from mha_onnx.errors import ConfigError

# ort: ONNX Runtime's contrib kernels; onnx: the standard Attention op (opset 23); openvino:
# onnx's standard ops with grouped K/V repeated (OpenVINO's Attention import takes no grouped
# K/V; it fuses them into its own attention, measured as fast as any contrib form there,
# docs/history/bench-notebook.md), verified on OpenVINO as well.
TARGETS = ("ort", "onnx", "openvino")
# Execution providers fuse has measured forms for (fuse --ep, target ort).
EPS = ("cpu", "cuda", "tensorrt")
# Kernel forms per mask kind (fuse --form KIND=FORM, target ort). The first is the CPU's
# default (docs/fusion-forms.md); for_ep holds the other providers' defaults.
FORMS: dict[str, tuple[str, ...]] = {
    "causal": ("gqa", "unidirectional", "bias"),
    "key_padding": ("auto", "loop", "mask", "bias", "gqa"),
}
# A KV cache: appended (presents = pasts + new) or shared (max-length buffers updated in
# place, lower/shared.py). A cache form changes the model's interface, so tune never picks it.
KV_CACHES = ("appended", "shared")


def form_help() -> str:
    """``causal=gqa|unidirectional|bias; key_padding=...; kv_cache=appended|shared``."""
    kinds = {**FORMS, "kv_cache": KV_CACHES}
    return "; ".join(f"{kind}={'|'.join(forms)}" for kind, forms in kinds.items())


@dataclass(frozen=True)
class FormPolicy:
    """What fuse lowers to: ``target`` and ``ep``, the form of each mask kind (defaults:
    fastest measured on the CPU, docs/fusion-forms.md; key_padding auto: GQA up to
    GQA_MAX_KEYS keys when right-padded, else by length) and the KV cache's form.
    ``given``: what the user set (--form kinds, kv_cache), said back when no block has it."""

    target: str = "ort"
    ep: str = "cpu"
    causal: str = "gqa"
    key_padding: str = "auto"
    kv_cache: str = "appended"
    given: tuple[str, ...] = field(default=(), compare=False)
    # Bidirectional GQA holds the [B, H, S, T] probabilities: fastest up to ~1k keys, then
    # slower than the Loop form and O(L^2) in memory (docs/fusion-forms.md, key padding).
    GQA_MAX_KEYS: ClassVar[int] = 1024
    # Below this many keys the Loop's per-row cost shows; MHA's key_padding_mask is as fast
    # as the original there (docs/fusion-forms.md, key padding by shape).
    LOOP_MIN_KEYS: ClassVar[int] = 128

    def __post_init__(self) -> None:
        for name, choices in (("target", TARGETS), ("ep", EPS), *FORMS.items(),
                              ("kv_cache", KV_CACHES)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"unknown {name.replace('_', ' ')} form {value!r}"
                                  if name in FORMS or name == "kv_cache"
                                  else f"unknown {name} {value!r}",
                                  hint=f"{name}: {' | '.join(choices)}")
        if self.kv_cache == "shared" and self.target != "ort":
            raise ConfigError("--kv-cache shared is an ONNX Runtime form",
                              hint="use --target ort")

    @classmethod
    def for_ep(cls, ep: str = "cpu", target: str = "ort") -> FormPolicy:
        """The forms measured fastest on an execution provider: CPU, docs/fusion-forms.md;
        CUDA (and TensorRT, whose sessions run ORT's contrib ops on CUDA), docs/gpu/: MHA
        unidirectional for causal blocks (0.08-0.62x of the unfused graph in float16, faster
        than GQA at every shape measured) and MHA with the padding as a dense bias (no If:
        the run-time checks cost more than they save on a GPU at short lengths). On CUDA,
        GQA is kept only where no other kernel is exact (soft-capping, sinks, windows; see
        gqa_for): ORT's CUDA GQA has no float32 kernel and its float16 right-padded branch
        disagreed with the original there (docs/gpu/2026-11-30-h200.md)."""
        if ep not in EPS:
            raise ConfigError(f"unknown execution provider {ep!r} for --ep",
                              hint=f"use {' | '.join(EPS)}")
        if ep == "cpu":
            return cls(target=target)
        return cls(target=target, ep=ep, causal="unidirectional", key_padding="bias")

    @classmethod
    def parse(cls, items: Sequence[str] = (), ep: str = "cpu", *, target: str = "ort",
              kv_cache: str | None = None) -> FormPolicy:
        """The CLI's ``--target``, ``--ep``, ``--form KIND=FORM`` (e.g. ``causal=bias``) and
        ``--kv-cache`` as one policy, over the defaults of ``ep``."""
        values: dict[str, str] = {}
        for item in items:
            kind, _, form = item.partition("=")
            kind = kind.strip().replace("-", "_")
            if kind not in (*FORMS, "kv_cache") or not form:
                raise ConfigError(f"malformed --form {item!r}", hint=f"use {form_help()}")
            values[kind] = form.strip()
        if kv_cache is not None:
            if values.get("kv_cache", kv_cache) != kv_cache:
                raise ConfigError(f"--kv-cache {kv_cache} and --form kv_cache="
                                  f"{values['kv_cache']} disagree", hint="give one of them")
            values["kv_cache"] = kv_cache
        return replace(cls.for_ep(ep, target), **values, given=tuple(values))

    @property
    def lowering(self) -> str:
        """The lowering the target takes: "ort" or "onnx" (OpenVINO's is onnx's)."""
        return "onnx" if self.target == "openvino" else self.target

    @property
    def ungroup(self) -> bool:
        """Whether grouped K/V are repeated to every head (OpenVINO's Attention import)."""
        return self.target == "openvino"

    def is_default(self) -> bool:
        """Nothing chosen: the CPU's forms for ONNX Runtime, nothing given."""
        return self == FormPolicy() and not self.given

    def gqa_for(self, *, softcap: bool = False, window: bool = False) -> bool:
        """Whether causal blocks go onto GroupQueryAttention: the CPU default; elsewhere
        only blocks no other kernel computes exactly in linear memory."""
        return self.causal == "gqa" or (self.ep != "cpu" and (softcap or window))

    def fuses_sinks(self) -> bool:
        """Attention sinks have ONNX Runtime's kernels only: GroupQueryAttention's head_sink,
        or MultiHeadAttention with one more key of zeros whose bias is the sink (the ONNX
        Attention op has none)."""
        return self.lowering == "ort"

    def softcap_on_gqa(self) -> bool:
        """Soft-capped scores have one fused kernel, GroupQueryAttention: ONNX Runtime's
        lowering, where causal blocks may go onto it."""
        return self.lowering == "ort" and self.gqa_for(softcap=True)

    def cached_on_kernel(self) -> bool:
        """Whether a block with an appended cache that GroupQueryAttention does not take
        runs on a kernel with past and present (lower/cached.py): the CPU's default forms
        and every GPU's; a CPU policy that moved causal blocks off GQA leaves the cache's
        Concats to the original's arithmetic around its kernel."""
        return self.causal == "gqa" or self.ep != "cpu"

    @staticmethod
    def padded_rows_on_gqa(half: bool) -> bool:
        """Whether GroupQueryAttention may take rows whose kept keys end before the total
        (seqlens_k below it: right padding, a cache's per-row lengths); ``half``: the block
        computes in float16/bfloat16. Never in half precision: ORT 1.31's CUDA GQA in
        float16 disagreed with the original on the right-padded batches of three graphs
        (0.22-0.60, docs/gpu/2026-11-30-h200.md), and its float16 CPU GQA with a window
        departs on the padded query rows once S exceeds the window. A float16 model is the
        kind deployed on a GPU, so the forms fused for the CPU must be exact there too:
        such blocks take GQA only when no key is padded."""
        return not half

    def right_padded_prompt_on_gqa(self, half: bool) -> bool:
        """Whether a causal block with padding takes GQA with seqlens_k behind a
        right-padding check: on the CPU, where padded_rows_on_gqa (on CUDA the right-padded
        form disagreed with the original; padded batches take the general kernel)."""
        return self.ep == "cpu" and self.padded_rows_on_gqa(half)

    def runs_pass(self, eps: tuple[str, ...] | None) -> bool:
        """Whether a pass measured for ``eps`` (None: every provider) runs under this policy
        (a GPU's list has no residual Sum, rotary fold or packed Q/K/V)."""
        return eps is None or self.ep in eps

    def candidates(self, kinds: set[str]) -> dict[str, FormPolicy]:
        """What `fuse --tune` times besides this policy: ``{"causal=bias": policy, ...}``,
        each other form of each mask kind in ``kinds`` (the kinds of the model's blocks).
        The cache's form is not a candidate: it changes the model's interface."""
        return {f"{kind}={form}": replace(self, **{kind: form}, given=(kind,))
                for kind in sorted(set(FORMS) & kinds) for form in FORMS[kind]
                if form != getattr(self, kind)}

    def unmatched(self, kinds: set[str]) -> list[str]:
        """Notes for a --form of a mask kind no fused block has (said, not silently kept)."""
        return [f"--form {kind}=... matched no block (the model has no "
                f"{kind.replace('_', ' ')} block)" for kind in self.given
                if kind in FORMS and kind not in kinds]
