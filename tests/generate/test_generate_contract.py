"""The generation contract as the generate guide writes it: its code block, run as written on a
decoder in both cache forms, generates what `mha-onnx generate` does (so the guide stays
true)."""

from __future__ import annotations

import pytest

from mha_onnx.generate import GenerationConfig, Generator
from mha_onnx.rewrite.policy import FormPolicy
from tests.paths import OPTIMUM, ROOT

GUIDE = ROOT / "docs" / "guide" / "generate.md"
FIXTURES = OPTIMUM
PROMPTS = [[20, 31, 5, 77, 12], [40, 3, 9, 91, 18, 60, 22, 7, 50], [66, 13, 84]]


def contract_block() -> str:
    text = GUIDE.read_text()
    start = text.index("```python", text.index("**The generation contract**"))
    code = text[start + len("```python"):]
    return code[:code.index("```")]


@pytest.fixture(scope="module")
def greedy():
    scope: dict = {}
    exec(compile(contract_block(), str(GUIDE), "exec"), scope)  # noqa: S102 - our guide
    return scope["greedy"]


@pytest.mark.parametrize("family", ["llama", "gemma"])  # (Optimum's Gemma: no position_ids)
@pytest.mark.parametrize("form", ["export", "appended", "shared"])
@pytest.mark.models
def test_the_readme_loop_generates_what_generate_does(greedy, tmp_path, family, form):
    from mha_onnx.rewrite import fuse_file

    model = FIXTURES / family / "model.onnx"
    if form != "export":
        fused = tmp_path / "model.onnx"
        fuse_file(model, fused, policy=FormPolicy(kv_cache=form))
        model = fused
    got = greedy(str(model), PROMPTS, 12, shared=form == "shared")
    with Generator(model) as generator:
        want = generator.generate(PROMPTS, GenerationConfig(12, eos=())).sequences
    assert got.tolist() == [list(row) for row in want]
