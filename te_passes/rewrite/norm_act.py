"""The norm / activation math of the compile-friendly rewrite: one implementation, in
:mod:`te_passes.te.norm_act` (shared with the untouched-model polyfills); re-exported here."""

from te_passes.te.norm_act import ACTIVATIONS, activation, normalize  # noqa: F401 - re-exported

__all__ = ["ACTIVATIONS", "activation", "normalize"]
