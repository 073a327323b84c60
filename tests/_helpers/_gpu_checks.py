"""Numerics checks shared by the GPU tests (tests/gpu/): compiled against eager TE."""

from __future__ import annotations

import torch

from te_passes.testing.gpu import REL_TOL, rel_err


def assert_close(tag, actual, expected, precision, scale=None):
    """Relative error of ``actual`` against ``expected``, at most ``REL_TOL[precision]``; returns it.
    ``scale``: measure it against that tensor's norm instead, for a gradient that is zero in exact
    arithmetic (attention key bias: on the query bias gradient's scale)."""
    assert actual.shape == expected.shape, f"{tag}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{tag}: non-finite values"
    if scale is None:
        err = rel_err(actual, expected)
    else:
        err = ((actual.float() - expected.float()).norm() / scale.float().norm().clamp_min(1e-30)).item()
    assert err <= REL_TOL[precision], f"{tag}: relative error {err:.3e} > {REL_TOL[precision]:.0e} ({precision})"
    return err
