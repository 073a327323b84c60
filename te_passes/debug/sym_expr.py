"""Symbolic sizes in ``.tegraph`` files (:mod:`te_passes.debug.graph_io`): parsed into sympy node by
node from their :mod:`ast`, within budgets, never evaluated as text (docs/cli.md "Guarantees").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from te_passes.debug.graph_safety import GraphFileError, check_name


#: Functions a symbolic size may call: sympy's and torch's size functions
#: (``torch.utils._sympy.functions``) as ``str(SymInt.node.expr)`` prints them.
_SYM_FUNCS = ("Max", "Min", "floor", "ceiling", "Mod", "FloorDiv", "CeilDiv", "CleanDiv", "ModularIndexing",
              "PythonMod", "FloorToInt", "CeilToInt", "TruncToInt", "IntTrueDiv", "ToFloat", "Abs", "Integer",
              "Rational", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "PowByNatural", "Identity")
_SYM_LIMITS = {"chars": 10_000, "depth": 100, "digits": 30, "result_digits": 100, "exponent": 64}


def _sym_funcs() -> dict[str, Any]:
    import sympy
    from torch.utils._sympy import functions as tf

    out: dict[str, Any] = {}
    for name in _SYM_FUNCS:
        out[name] = getattr(tf, name, None) or getattr(sympy, name)
    out["Mod"] = sympy.Mod  # str() of sympy.Mod; torch's Mod prints the same
    return out


def parse_sym_expr(expr: Any, where: str, symbols: dict[str, Any] | None = None) -> Any:
    """The sympy expression ``expr`` (text printed by ``str(SymInt.node.expr)``) stands for, built node by
    node from its :mod:`ast` (nothing is evaluated: :func:`sympy.sympify` never sees the text): symbols,
    integers of at most 30 digits, ``+ - * / // % **`` (``**`` only to an integer power of at most 64,
    results of at most 100 digits), comparisons, ``& | ~``, and calls of :data:`_SYM_FUNCS`. ``symbols``
    maps names to the symbols to use (others are created ``integer=True, positive=True``).

    Raises:
        GraphFileError: anything else (attribute access, other calls, strings, ``9**9**9**9``, ...).
    """
    import ast
    import math
    import operator

    import sympy

    def bad(why: str) -> GraphFileError:
        return GraphFileError(f"{where}: symbolic size {str(expr)[:80]!r} is not a size expression ({why})")

    if not isinstance(expr, str) or len(expr) > _SYM_LIMITS["chars"]:
        raise bad("not a string of at most 10000 characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise bad("does not parse") from None
    depth = {id(tree.body): 1}
    for n in ast.walk(tree):  # breadth first: parents before children
        for c in ast.iter_child_nodes(n):
            depth[id(c)] = depth.get(id(n), 1) + 1
            if depth[id(c)] > _SYM_LIMITS["depth"]:
                raise bad(f"nested more than {_SYM_LIMITS['depth']} levels")
    funcs = _sym_funcs()
    syms = dict(symbols or {})
    binops = {ast.Pow: operator.pow, ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: funcs["FloorDiv"], ast.Mod: sympy.Mod, ast.BitAnd: sympy.And,
              ast.BitOr: sympy.Or}

    def big(v: Any) -> bool:
        return isinstance(v, sympy.Integer) and abs(int(v)).bit_length() > _SYM_LIMITS["result_digits"] * 3.33

    def build(n: ast.AST) -> Any:
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            if len(str(abs(n.value))) > _SYM_LIMITS["digits"]:
                raise bad(f"an integer of more than {_SYM_LIMITS['digits']} digits")
            return sympy.Integer(n.value)
        if isinstance(n, ast.Constant) and isinstance(n.value, float) and math.isfinite(n.value):
            return sympy.Float(n.value)
        if isinstance(n, ast.Name):
            if n.id in ("True", "False"):
                return sympy.true if n.id == "True" else sympy.false
            if not n.id.isidentifier() or n.id.startswith("_") or n.id in funcs or len(n.id) > 64:
                raise bad(f"name {n.id[:20]!r}")
            if n.id not in syms:
                syms[n.id] = sympy.Symbol(n.id, integer=True, positive=True)
            return syms[n.id]
        if isinstance(n, ast.UnaryOp):
            v = build(n.operand)
            if isinstance(n.op, ast.USub):
                return -v
            if isinstance(n.op, ast.UAdd):
                return v
            if isinstance(n.op, (ast.Invert, ast.Not)):
                return sympy.Not(v)
        if isinstance(n, ast.BinOp):
            a, b = build(n.left), build(n.right)
            op = type(n.op)
            if op is ast.Pow:
                if not (isinstance(b, sympy.Integer) and 0 <= int(b) <= _SYM_LIMITS["exponent"]):
                    raise bad(f"a power that is not an integer from 0 to {_SYM_LIMITS['exponent']}")
                if isinstance(a, sympy.Number) and abs(float(a)) > 1 \
                        and int(b) * math.log10(abs(float(a))) > _SYM_LIMITS["result_digits"]:
                    raise bad(f"a number of more than {_SYM_LIMITS['result_digits']} digits")
            if op not in binops:
                raise bad(f"operator {op.__name__}")
            out = binops[op](a, b)
            if big(out):
                raise bad(f"a number of more than {_SYM_LIMITS['result_digits']} digits")
            return out
        if isinstance(n, ast.Compare) and len(n.ops) == 1:
            a, b = build(n.left), build(n.comparators[0])
            rel = {ast.Lt: sympy.Lt, ast.LtE: sympy.Le, ast.Gt: sympy.Gt, ast.GtE: sympy.Ge, ast.Eq: sympy.Eq,
                   ast.NotEq: sympy.Ne}.get(type(n.ops[0]))
            if rel is not None:
                return rel(a, b)
        if isinstance(n, ast.BoolOp):
            vals = [build(v) for v in n.values]
            return (sympy.And if isinstance(n.op, ast.And) else sympy.Or)(*vals)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in funcs and not n.keywords \
                and 0 < len(n.args) <= 8:
            out = funcs[n.func.id](*[build(a) for a in n.args])
            if big(out):
                raise bad(f"a number of more than {_SYM_LIMITS['result_digits']} digits")
            return out
        raise bad(f"{type(n).__name__} not allowed")

    try:
        return build(tree.body)
    except GraphFileError:
        raise
    except Exception as e:  # noqa: BLE001 - a sympy function refusing its arguments
        raise bad(f"{type(e).__name__}: {' '.join(str(e).split())[:80]}") from None


def check_sym_expr(expr: Any, where: str) -> str:
    """``expr`` when :func:`parse_sym_expr` accepts it.

    Raises:
        GraphFileError: see :func:`parse_sym_expr`.
    """
    parse_sym_expr(expr, where)
    return expr


# --------------------------------------------------------------------------- the symbols of a graph file
def graph_symbols(graph: torch.fx.Graph) -> dict[str, dict[str, Any]]:
    """``{name: {"hint", "lower", "upper", "positive"}}`` of every symbol in the graph's fake values (``val`` /
    ``example_value``), read from their ``ShapeEnv`` (``backed_var_to_val``, ``var_to_range``); ``None`` for an
    unknown hint or an unbounded range end."""
    import sympy

    def bound(x: Any) -> int | None:  # None: +-oo, or not an integer
        return int(x) if isinstance(x, (int, sympy.Integer)) and not isinstance(x, bool) else None

    def sizes(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            yield from (*v.shape, *v.stride())
        elif isinstance(v, (list, tuple)):
            for x in v:
                yield from sizes(x)
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            yield v

    out: dict[str, dict[str, Any]] = {}
    for s in sizes([[n.meta.get("val"), n.meta.get("example_value")] for n in graph.nodes]):
        if not isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        env = s.node.shape_env
        for sym in getattr(s.node.expr, "free_symbols", ()):
            if str(sym) not in out:
                hint = env.backed_var_to_val.get(sym) if env is not None else None
                vr = env.var_to_range.get(sym) if env is not None else None
                out[str(sym)] = {"hint": bound(hint) if hint is not None else None,
                                 "lower": bound(vr.lower) if vr is not None else None,
                                 "upper": bound(vr.upper) if vr is not None else None,
                                 "positive": bool(sym.is_positive)}
    return out


def check_symbols(symbols: Any, path: str) -> None:
    """A graph file's ``symbols`` field (``None`` or :func:`graph_symbols`' form) checked.

    Raises:
        GraphFileError: naming ``path`` and the first wrong entry.
    """
    if symbols is None:
        return
    if not isinstance(symbols, dict):
        raise GraphFileError(f"{path}: 'symbols' is a {type(symbols).__name__}, expected dict")
    for k, v in symbols.items():
        check_name(k, f"{path}: symbols key")
        if not isinstance(v, dict) or any(v.get(f) is not None and (not isinstance(v.get(f), int)
                                                                     or isinstance(v.get(f), bool))
                                          for f in ("hint", "lower", "upper")):
            raise GraphFileError(f"{path}: symbols[{k!r}] is not {{hint, lower, upper}} of ints")


def restore_symbols(shape_env: Any, symbols: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Recreate :func:`graph_symbols`' symbols in ``shape_env`` (a ``ShapeEnv``) with their hints and value
    ranges; returns ``{name: sympy.Symbol}``."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges

    out = {}
    for name, info in symbols.items():
        sym = out[name] = sympy.Symbol(name, integer=True, positive=True) if info.get("positive", True) \
            else sympy.Symbol(name, integer=True)
        if info.get("hint") is not None:
            shape_env.backed_var_to_val[sym] = sympy.Integer(info["hint"])
        lo, hi = info.get("lower"), info.get("upper")
        if lo is not None or hi is not None:
            shape_env.var_to_range[sym] = ValueRanges(sympy.Integer(lo) if lo is not None else -sympy.oo,
                                                      sympy.Integer(hi) if hi is not None else sympy.oo)
    return out
