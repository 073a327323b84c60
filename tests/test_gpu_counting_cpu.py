"""CPU check of the GPU suite's construction counter (tests/gpu/test_hoist_recipe_lookups_gpu.py):
it must leave TE's quantizer class constructible afterwards (a mock.patch of ``__new__`` did not,
which broke every later fp8 test in the H200 run of 2026-11-29)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytest.importorskip("transformer_engine.pytorch")


def _gpu_test_module():
    path = pathlib.Path(__file__).parent / "gpu" / "test_hoist_recipe_lookups_gpu.py"
    spec = importlib.util.spec_from_file_location("_hoist_gpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_count_constructions_restores_quantizer_class():
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    counting = _gpu_test_module()._count_constructions
    for _ in range(2):
        with counting() as counts:
            Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))
        assert counts["other"] == 1  # built by this test, not by a _rebuild_quantizer call
        q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))
        assert type(q) is Float8CurrentScalingQuantizer
