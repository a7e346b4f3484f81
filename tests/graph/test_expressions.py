"""graph/expressions.py: the one reader of dims written as arithmetic on symbols (the input
generator, verification's key lengths, the mask evaluator and dim equality all use it)."""

from __future__ import annotations

import pytest

from mha_onnx.graph.expressions import evaluate, is_expression, provably_equal, symbols


def test_symbols_and_values_of_the_exporters_spellings():
    assert symbols("past_seq + seq_q") == {"past_seq", "seq_q"}
    assert symbols("sequence_length // 10 - 1") == {"sequence_length"}
    assert symbols("not an expression (") == set() and symbols("x" * 300) == set()
    assert evaluate("sequence_length // 10 - 1", {"sequence_length": 160}) == 15
    assert evaluate("-seq % 4", {"seq": 7}) == 1 and evaluate("seq", {}) is None


def test_the_symbolic_inferences_spellings_are_read_too():
    """graph/symbolic writes sympy's text: floor/ceiling/Max/Min/Mod calls, exact division
    inside them. A speech encoder's conv stack, read both ways, gives the same lengths."""
    ours, torchs = "floor(floor(sequence_length/5)/2) - 1", "((sequence_length//10)) - 1"
    assert symbols(ours) == {"sequence_length"}
    for n in (20, 21, 99, 160):
        assert evaluate(ours, {"sequence_length": n}) == evaluate(torchs, {"sequence_length": n})
    assert evaluate("Max(0, x - 4) + ceiling(x/3) + Mod(x, 4)", {"x": 7}) == 3 + 3 + 3
    assert evaluate("x/2", {"x": 3}) is None  # not whole: not a dim
    assert evaluate("floor(x/0)", {"x": 3}) is None and evaluate("Mod(x, 0)", {"x": 3}) is None


@pytest.mark.parametrize("dim, expression", [("a + b", True), ("2*seq", True), ("seq_q", False),
                                             ("batch", False), (5, False), (None, False)])
def test_an_expression_is_arithmetic_not_a_name(dim, expression):
    assert is_expression(dim) is expression


def test_equality_is_proven_not_guessed():
    assert provably_equal("((seq**2)//seq)", "seq")
    assert provably_equal("past + seq", "seq + past")
    assert not provably_equal("past + seq", "past + seq + 1")
    assert not provably_equal("seq +", "seq")  # not an expression: not equal
