"""FormPolicy (rewrite/policy.py): every form choice in one place. The CLI's choices come from
its tables, --kv-cache and --form kv_cache= meet in one parse, a cache form only ONNX Runtime
has is refused before anything is read, tune's candidates are the policy's, and the ORT
lowerings are a table whose every row takes some block."""

from __future__ import annotations

from dataclasses import replace

import onnx_ir as ir
import pytest
from click.testing import CliRunner

from mha_onnx.cli import main
from mha_onnx.errors import ConfigError
from mha_onnx.rewrite.lower.ort import LOWERINGS, lowering_for
from mha_onnx.rewrite.policy import EPS, FORMS, KV_CACHES, TARGETS, FormPolicy, form_help
from mha_onnx.rewrite.sdpa import SdpaInfo
from tests.sdpa_graphs import Meaning, cached_model, sdpa_model


def test_parse_gathers_target_ep_forms_and_the_cache():
    policy = FormPolicy.parse(["causal=bias", "key-padding=mask"], "cuda", target="ort",
                              kv_cache="shared")
    assert (policy.target, policy.ep, policy.causal, policy.key_padding, policy.kv_cache) \
        == ("ort", "cuda", "bias", "mask", "shared")
    assert set(policy.given) == {"causal", "key_padding", "kv_cache"}
    assert FormPolicy.parse([], "cuda").key_padding == "bias"  # the EP's defaults beneath
    assert FormPolicy.parse([]).is_default() and not FormPolicy.parse(["causal=gqa"]).is_default()


@pytest.mark.parametrize("make, says", [
    (lambda: FormPolicy.parse(["kv_cache=shared"], kv_cache="appended"), "disagree"),
    (lambda: FormPolicy.parse(["causal"]), "malformed --form"),
    (lambda: FormPolicy.parse(["causal=loop"]), "unknown causal form"),
    (lambda: FormPolicy.parse([], "rocm"), "unknown execution provider"),
    (lambda: FormPolicy(target="tvm"), "unknown target"),
    (lambda: FormPolicy.parse([], target="onnx", kv_cache="shared"), "ONNX Runtime form"),
])
def test_a_choice_that_cannot_be_made_is_one_config_error(make, says):
    with pytest.raises(ConfigError, match=says):
        make()


def test_the_cli_reads_its_choices_from_the_policy():
    text = CliRunner().invoke(main, ["fuse", "--help"]).output
    assert " ".join(form_help().split()) in " ".join(text.split())
    for choices in (TARGETS, EPS, KV_CACHES):
        assert "|".join(choices) in text.replace("\n", "").replace(" ", "")


def test_a_shared_cache_for_another_target_is_refused_before_the_model_is_read(tmp_path):
    """The old code fused (and verified) the whole model first; the model here does not
    even exist, so only a refusal up front says the cache form."""
    result = CliRunner().invoke(main, ["fuse", str(tmp_path / "absent.onnx"), "-o",
                                       str(tmp_path / "out.onnx"), "--target", "onnx",
                                       "--kv-cache", "shared"])
    assert result.exit_code == 2 and "ONNX Runtime form" in result.output, result.output


def test_tune_candidates_are_every_other_form_of_the_models_kinds():
    policy = FormPolicy()
    causal = policy.candidates({"causal"})
    assert list(causal) == ["causal=unidirectional", "causal=bias"]
    assert causal["causal=bias"].causal == "bias" and causal["causal=bias"].kv_cache == "appended"
    both = policy.candidates({"causal", "key_padding", "none"})
    assert len(both) == len(FORMS["causal"]) + len(FORMS["key_padding"]) - 2
    assert not any(name.startswith("kv_cache") for name in both)  # it changes the interface
    assert policy.candidates({"none"}) == {}


def test_a_form_no_block_has_is_said():
    policy = FormPolicy.parse(["key_padding=loop", "causal=bias"], kv_cache="appended")
    notes = policy.unmatched({"causal"})
    assert len(notes) == 1 and "key_padding=..." in notes[0] and "no key padding" in notes[0]


def _info(model: ir.Model) -> SdpaInfo:
    return SdpaInfo.of(next(n for n in model.graph if n.op_type == "Sdpa"))


def test_every_lowering_takes_some_block_and_the_first_that_takes_it_lowers():
    """Each row of LOWERINGS reached by a block the rows before it do not take."""
    sink = ir.Value(name="sink")
    cases = {
        "GroupQueryAttention": (_info(sdpa_model(Meaning(causal=True))), FormPolicy()),
        "cached: MultiHeadAttention past/present": (
            _info(cached_model(Meaning(causal=True, alignment="bottom-right"))), FormPolicy()),
        "MultiHeadAttention + sinks": (replace(_info(sdpa_model(Meaning())), sink=sink),
                                       FormPolicy()),
        "MultiHeadAttention": (_info(sdpa_model(Meaning())), FormPolicy()),
        "MultiHeadAttention causal": (_info(sdpa_model(Meaning(causal=True))),
                                      FormPolicy(causal="bias")),
        "key padding": (_info(sdpa_model(Meaning(padded=True))), FormPolicy()),
        "MultiHeadAttention + attention_bias": (
            _info(sdpa_model(Meaning(causal=True, bias=True))), FormPolicy(causal="bias")),
    }
    assert list(cases) == [row.kernel for row in LOWERINGS]
    for kernel, (info, policy) in cases.items():
        assert lowering_for(info, policy).kernel == kernel


def test_every_veto_of_a_kernel_is_the_policys():
    """What the lowerings ask before they put a block on a kernel, answered by the policy
    alone: sinks and soft-capping fuse for ONNX Runtime only; a cache goes onto a kernel
    with past/present under the CPU's default forms and every GPU's; half precision never
    runs GQA over rows padded short of the total, and a padded prompt takes GQA behind a
    right-padding check on the CPU only; the GPU's pass list is shorter."""
    cpu, cuda = FormPolicy(), FormPolicy.for_ep("cuda")
    onnx, openvino = FormPolicy(target="onnx"), FormPolicy(target="openvino")
    assert [p.fuses_sinks() for p in (cpu, cuda, onnx, openvino)] == [True, True, False, False]
    assert [p.softcap_on_gqa() for p in (cpu, cuda, onnx, FormPolicy(causal="bias"))] == [
        True, True, False, False]
    assert [p.cached_on_kernel() for p in (cpu, cuda, FormPolicy(causal="bias"))] == [
        True, True, False]
    assert FormPolicy.padded_rows_on_gqa(half=False) and not FormPolicy.padded_rows_on_gqa(True)
    assert [(p.right_padded_prompt_on_gqa(False), p.right_padded_prompt_on_gqa(True))
            for p in (cpu, cuda)] == [(True, False), (False, False)]
    assert cpu.runs_pass(("cpu",)) and not cuda.runs_pass(("cpu",)) and cuda.runs_pass(None)
