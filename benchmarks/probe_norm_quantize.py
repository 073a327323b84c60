#!/usr/bin/env python3
"""How close the untouched norm + te.Linear quantize comes to TE's fused LayerNorm + FP8 kernel (H200).

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/probe_norm_quantize.py

TE eager's te.LayerNormLinear under DelayedScaling writes FP8 from its norm kernel
(``tex.layernorm_fwd`` / ``rmsnorm_fwd`` with a ``Float8Quantizer``: ``Impl::FULLY_FUSED``). The
compiled split quantizes the norm's output with the same quantizer: from bf16 (before
``widen_quantized_inputs``) or from the fp32 norm of fp32 copies (after). Per path and shape: FP8 bytes
that differ from the fused kernel's, the amax TE records, mu / rsigma against the fused call's.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import torch  # noqa: I001  (torch before transformer_engine)


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def quantizer(scale):
        return Float8Quantizer(torch.full((1,), scale, device="cuda"), torch.zeros(1, device="cuda"),
                               tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)

    gen = torch.Generator(device="cuda").manual_seed(0)
    print("norm | rows x hidden | scale | path | fp8 bytes != fused | amax (fused / path) | max |d mu| | max |d rsigma|")
    for rms in (False, True):
        for rows, hidden in ((512, 512), (2048, 2048), (4096, 4096)):
            x = torch.randn(rows, hidden, generator=gen, device="cuda").to(torch.bfloat16) * 3 + 0.5
            w = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
            b = None if rms else (torch.randn(hidden, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
            for scale in (1.0, 37.5):

                def norm(xx, ww, bb, q, otype):
                    if rms:
                        return tex.rmsnorm_fwd(xx, ww, 1e-5, None, q, TE_DType[otype], 0, False)
                    return tex.layernorm_fwd(xx, ww, bb, 1e-5, None, q, TE_DType[otype], 0, False)

                qf = quantizer(scale)
                fused, mu_f, rs_f = norm(x, w, b, qf, torch.bfloat16)
                paths = {}
                y16, mu16, rs16 = norm(x, w, b, None, torch.bfloat16)
                paths["bf16 then quantize (before)"] = (y16, mu16, rs16)
                y32, mu32, rs32 = norm(x.float(), w.float(), None if b is None else b.float(), None, torch.float32)
                paths["fp32 then quantize (widen_quantized_inputs)"] = (y32, mu32, rs32)
                for name, (y, mu, rs) in paths.items():
                    q = quantizer(scale)
                    out = q(y)
                    diff = (out._data != fused._data).sum().item()
                    dmu = 0.0 if rms else (mu - mu_f).abs().max().item()
                    drs = (rs - rs_f).abs().max().item()
                    print(f"{'RMSNorm' if rms else 'LayerNorm'} | {rows} x {hidden} | {scale} | {name} | {diff} of "
                          f"{out._data.numel()} | {qf.amax.item():.6g} / {q.amax.item():.6g} | {dmu:.3g} | {drs:.3g}",
                          flush=True)


if __name__ == "__main__":
    main()
