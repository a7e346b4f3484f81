"""Dims written as integer arithmetic on symbols, in one place: ``past_seq + seq_q`` (how a
KV-cache model names its total length), torch's ``((seq**2)//seq)``, a speech encoder's
``sequence_length // 10 - 1``. Read with Python's ``ast`` (never ``eval``), evaluated for
given values, their symbols named, and two of them proven equal with sympy.
"""

from __future__ import annotations

import ast
import functools
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.Mod: operator.mod}
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
    """The symbols of an expression (``past + seq`` -> {past, seq}); none if it is not one."""
    tree = _tree(text)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree else set()


def evaluate(dim: int | str | None, values: dict[str, int]) -> int | None:
    """A dim's value: an int, a symbol, or integer arithmetic on symbols and ints; None when
    a symbol has no value, a division is by zero, a power is out of 0..8 or the text is
    anything else."""
    if isinstance(dim, int):
        return dim
    if not isinstance(dim, str):
        return None
    tree = _tree(dim)
    return None if tree is None else _value(tree, values)


def _value(node: ast.AST, values: dict[str, int]) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return values.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand, values)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, values), _value(node.right, values)
        if left is None or right is None or (isinstance(node.op, ast.Pow) and not 0 <= right <= 8) \
                or (isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0):
            return None
        return _OPS[type(node.op)](left, right)
    return None


@functools.lru_cache(maxsize=4096)
def provably_equal(a: str, b: str) -> bool:
    """Whether two expressions are equal for every positive integer value of their symbols
    (sympy simplifies their difference to 0); False where either is not an expression."""
    import sympy

    try:
        names = symbols(a) | symbols(b)
        local = {n: sympy.Symbol(n, integer=True, positive=True) for n in names}
        return sympy.simplify(sympy.sympify(a, locals=local)
                              - sympy.sympify(b, locals=local)) == 0
    except (sympy.SympifyError, TypeError, ValueError, SyntaxError):
        return False
