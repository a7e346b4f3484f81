"""Dims written as integer arithmetic on symbols, in one place: ``past_seq + seq_q`` (how a
KV-cache model names its total length), torch's ``((seq**2)//seq)``, a speech encoder's
``sequence_length // 10 - 1``, and sympy's text as graph/symbolic writes it
(``floor(sequence_length/10) - 1``). Read with Python's ``ast`` (never ``eval``), evaluated
exactly for given values, their symbols named, and two of them proven equal with sympy.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import re
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.Mod: operator.mod,
        ast.Div: operator.truediv}
_CALLS = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min,
          "Mod": operator.mod}
_LONGEST = 200  # characters: longer dims are not parsed (a fuzzed file's dim_param)


def _tree(text: str) -> ast.expr | None:
    if len(text) > _LONGEST:
        return None
    try:
        return ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None


def is_expression(dim: object) -> bool:
    """Whether a dim is arithmetic on symbols rather than one symbol (or an int)."""
    return isinstance(dim, str) and bool(re.search(r"[-+*/ ]", dim))


def symbols(text: str) -> set[str]:
    """The symbols of an expression (``past + seq`` -> {past, seq}; ``floor(seq/2)`` ->
    {seq}); none if it is not one."""
    tree = _tree(text)
    if tree is None:
        return set()
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}


def evaluate(dim: int | str | None, values: dict[str, int]) -> int | None:
    """A dim's value: an int, a symbol, or integer arithmetic on symbols and ints (with
    sympy's ``floor``, ``ceiling``, ``Max``, ``Min``, ``Mod`` and exact division inside
    them, as symbolic shape inference writes dims); None when a symbol has no value, a
    division is by zero, a power is out of 0..8, the result is not whole or the text is
    anything else."""
    if isinstance(dim, int):
        return dim
    if not isinstance(dim, str):
        return None
    tree = _tree(dim)
    value = None if tree is None else _value(tree, values)
    return None if value is None or value.denominator != 1 else int(value)


def _value(node: ast.AST, values: dict[str, int]) -> Fraction | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Name):
        return None if values.get(node.id) is None else Fraction(values[node.id])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand, values)
        return None if inner is None else -inner
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in _CALLS and not node.keywords:
        args = [_value(a, values) for a in node.args]
        if any(a is None for a in args) or (node.func.id == "Mod" and args[1] == 0):
            return None
        return Fraction(_CALLS[node.func.id](*args))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, values), _value(node.right, values)
        if left is None or right is None or (isinstance(node.op, ast.Pow) and not (
                right.denominator == 1 and 0 <= right <= 8)) or (isinstance(
                    node.op, (ast.FloorDiv, ast.Mod, ast.Div)) and right == 0):
            return None
        return Fraction(_OPS[type(node.op)](left, right))
    return None


def symbol(name: str):
    """A dim's symbol in sympy: an integer, never negative."""
    import sympy

    return sympy.Symbol(name, integer=True, nonnegative=True)


def to_sympy(text: str):
    """A dim's text as a sympy expression (the same grammar as ``evaluate``), or None."""
    tree = _tree(text)
    try:
        return None if tree is None else _sympy(tree)
    except (ValueError, TypeError, KeyError, ZeroDivisionError):
        return None


def _sympy(node: ast.AST):
    import sympy

    if isinstance(node, ast.Constant) and type(node.value) is int:
        return sympy.Integer(node.value)
    if isinstance(node, ast.Name):
        return symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_sympy(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _sympy(node.left), _sympy(node.right)
        if isinstance(node.op, ast.Mod):
            return sympy.Mod(left, right)
        return left // right if isinstance(node.op, ast.FloorDiv) else _OPS[type(node.op)](
            left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        calls = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max,
                 "Min": sympy.Min, "Mod": sympy.Mod}
        return calls[node.func.id](*(_sympy(a) for a in node.args))
    raise ValueError("not a dim expression")


@functools.lru_cache(maxsize=4096)
def provably_equal(a: str, b: str) -> bool:
    """Whether two expressions are equal for every positive integer value of their symbols
    (sympy simplifies their difference to 0); False where either is not an expression."""
    import sympy

    left, right = to_sympy(a), to_sympy(b)
    if left is None or right is None:
        return False
    positive = {s: sympy.Symbol(s.name, integer=True, positive=True)
                for s in left.free_symbols | right.free_symbols}
    return sympy.simplify((left - right).xreplace(positive)) == 0
