"""The reasons te_passes gives for a TE attention call it leaves eager read as one sentence (session 20's user
trial: ``attention_dropout`` in training read "... is not verified against TE eager is not expressed by the
fused-attention op path"). CPU, fake GPU, a recording backend carrying te_inductor's mark
(tests/runtime/test_untouched.py)."""

from __future__ import annotations

import re

import pytest

te = pytest.importorskip("transformer_engine.pytorch")

from te_passes.compat.untouched import polyfills as untouched  # noqa: E402
from tests.runtime.test_untouched import _layer, _run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_attention_dropout_in_training_island_reason_is_one_sentence():
    untouched.clear_island_records()
    _run(lambda: _layer(attention_dropout=0.1), (16, 2, 64), calls=1)
    (island,) = [i for i in untouched.island_records() if i.te_module == "te.FusedAttention"]
    assert re.fullmatch(r"attention_dropout=0\.1 in training \(the op's philox rng state under CUDA-graph replay "
                        r"is not verified against TE eager\) is not expressed by the fused-attention op path",
                        island.reason), island.reason
