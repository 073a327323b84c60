"""Userbuffers (UB) query nodes in an FX graph: which call a node is and its constant arguments.

See docs/internals.md#te_passesteub_queriespy."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from te_passes.te.ub import TE_UB_MODULE, UB_PREDICATE_METHODS, UB_QUERY_FUNCTIONS

# Argument names of the folded TE functions (module/base.py signatures).
_SIGNATURES = {
    "get_ub_is_fp8": ("name", "use_fp8"),
    "get_ub": ("name", "use_fp8"),
    "is_ub_initialized": (),
    "using_cublasmp_backend": (),
    "ub_query": ("name", "use_fp8", "method"),
}


#: Marker attribute of a runtime function that is a UB query; its value is the query's name. The runtime stamps
#: its own functions with it (``compat.table.stamp``; ``compat/ub/guard.py`` for ``ub_query``).
UB_QUERY_ATTR = "_te_passes_ub_query"


def ub_query_name(name: str) -> str:
    """``name``, checked as the name of a UB query a function may be stamped with (:data:`UB_QUERY_ATTR`).

    Raises:
        ValueError: ``name`` is not one of the known queries (``get_ub_is_fp8``, ``get_ub``, ``ub_query``, ...)."""
    if name not in _SIGNATURES:
        raise ValueError(f"unknown UB query {name!r}; known: {sorted(_SIGNATURES)}")
    return name


class UbQueryNotConstant(Exception):
    """A UB query node whose arguments are not all compile-time constants (the message says which)."""


def ub_query_function(target: Any) -> str | None:
    """Which UB function an FX ``call_function`` target is, or ``None``."""
    fn = target
    for _ in range(4):
        fn = getattr(fn, "__te_passes_original__", fn)
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if mod == TE_UB_MODULE and name in (*UB_QUERY_FUNCTIONS, "get_ub"):
        return name
    own = getattr(fn, "__dict__", None)  # the function's own stamp, never an attribute lookup on an op
    stamped = own.get(UB_QUERY_ATTR) if isinstance(own, dict) else None
    return stamped if stamped in _SIGNATURES else None


def bind_ub_query(node: torch.fx.Node, fn_name: str) -> tuple:
    """Positional argument tuple of a UB call node of ``fn_name`` (a key of ``_SIGNATURES``), all
    constants (``ub_query``'s ``method`` defaults to ``"is_fp8_ubuf"``). Raises
    :class:`UbQueryNotConstant` for too many / missing / unexpected arguments or a non-constant one."""
    params = _SIGNATURES[fn_name]
    values = list(node.args)
    if len(values) > len(params):
        raise UbQueryNotConstant(f"{len(values)} arguments for {fn_name}{params}")
    for p in params[len(values):]:
        if p in node.kwargs:
            values.append(node.kwargs[p])
        elif fn_name == "ub_query" and p == "method":
            values.append("is_fp8_ubuf")
        else:
            raise UbQueryNotConstant(f"missing argument {p!r} of {fn_name}")
    extra = set(node.kwargs) - set(params)
    if extra:
        raise UbQueryNotConstant(f"unexpected keyword arguments {sorted(extra)} for {fn_name}")
    for p, v in zip(params, values):
        if isinstance(v, torch.fx.Node) or not isinstance(v, (str, bool, int)):
            raise UbQueryNotConstant(f"argument {p}={v!r} is not a compile-time constant")
    return tuple(values)


def find_ub_queries(graph: torch.fx.Graph) -> tuple[list[tuple[torch.fx.Node, str, tuple]],
                                                    list[tuple[torch.fx.Node, str]]]:
    """The UB query nodes of ``graph`` as ``(node, api, args)`` (``api`` e.g. ``"get_ub_is_fp8"``
    or ``"get_ub.with_cublasmp"``, the key :meth:`~te_passes.te.ub.UbSnapshot.query` takes), and
    the query nodes that cannot be folded as ``(node, reason)``, both in graph order."""
    out, refused = [], []
    for node in graph.nodes:
        try:
            if node.op == "call_function":
                fn = ub_query_function(node.target)
                if fn in UB_QUERY_FUNCTIONS:
                    out.append((node, fn, bind_ub_query(node, fn)))
                elif fn == "ub_query":
                    name, use_fp8, method = bind_ub_query(node, fn)
                    if method not in UB_PREDICATE_METHODS:
                        raise UbQueryNotConstant(f"method {method!r} is not one of {list(UB_PREDICATE_METHODS)}")
                    out.append((node, f"get_ub.{method}", (name, bool(use_fp8))))
            elif node.op == "call_method" and node.target in UB_PREDICATE_METHODS:
                recv = node.args[0] if node.args else None
                if isinstance(recv, torch.fx.Node) and recv.op == "call_function" \
                        and ub_query_function(recv.target) == "get_ub":
                    if len(node.args) != 1 or node.kwargs:
                        raise UbQueryNotConstant(f"{node.target}() takes no arguments, got {node.args[1:]} {node.kwargs}")
                    name, use_fp8 = bind_ub_query(recv, "get_ub")
                    out.append((node, f"get_ub.{node.target}", (name, bool(use_fp8))))
        except UbQueryNotConstant as e:
            refused.append((node, str(e)))
    return out, refused


def describe_ub_query(node: torch.fx.Node) -> tuple[str, tuple]:
    """``(api, args)`` of a node :func:`find_ub_queries` listed (the same key it returned)."""
    if node.op == "call_method":
        name, use_fp8 = bind_ub_query(node.args[0], "get_ub")
        return f"get_ub.{node.target}", (name, bool(use_fp8))
    fn = ub_query_function(node.target)
    args = bind_ub_query(node, fn)
    if fn == "ub_query":
        return f"get_ub.{args[2]}", (args[0], bool(args[1]))
    if fn == "get_ub_is_fp8":
        return fn, (args[0], bool(args[1]))
    return fn, args
