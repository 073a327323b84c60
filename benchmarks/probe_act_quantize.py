#!/usr/bin/env python3
"""How close the untouched LayerNormMLP's activation (forward and backward) + FP8 cast comes to TE's
fused kernels under DelayedScaling (H200), and the norm with TE's kernel in fp32 out.

    source .gpu/s/env.sh; PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/probe_act_quantize.py

TE eager (``module/layernorm_mlp.py``, TE 2.20.2) quantizes fc2's input in the activation kernel
(``tex.gelu(fc1_out, fc2_input_quantizer)``) and fc1's grad output in ``tex.dbias_dgelu(fc2_dgrad,
fc1_out, quantizer)``; both compute in fp32 from bf16. Per path: FP8 bytes that differ from the fused
kernel's, the amax TE records (fused / path), and for the backward the bias gradient's max |diff|.
Paths: Inductor's fp32 GELU / GELU backward (session 13's rule), TE's own elementwise kernels on
fp32 copies (``tex.gelu(x.float(), None)``, ``tex.dgelu(g.float(), x.float(), None)``: what
``widen_quantized_inputs`` feeds now) then TE's quantize / ``bgrad_quantize``. Norm, against the
fused FP8 call: the output rebuilt in fp32 by Inductor from the bf16 kernel's mean / rsigma (the
pass's rule), ``tex.layernorm_fwd`` with bf16 input and fp32 output, and TE's kernel on fp32
copies (session 12's rule), each then quantized. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import torch  # noqa: I001  (torch before transformer_engine)
import torch.nn.functional as F


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def quantizer(scale, fmt=tex.DType.kFloat8E4M3, col=False):
        return Float8Quantizer(torch.full((1,), scale, device="cuda"), torch.zeros(1, device="cuda"), fmt,
                               rowwise=True, columnwise=col)

    ind_gelu = torch.compile(lambda x: F.gelu(x, approximate="tanh"))
    ind_dgelu = torch.compile(lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("what | rows x n | scale | path | fp8 bytes != fused | amax (fused / path) | max |d dbias|")
    for rows, n in ((512, 2048), (4096, 8192)):
        x = (torch.randn(rows, n, generator=gen, device="cuda") * 2).to(torch.bfloat16)
        g = (torch.randn(rows, n, generator=gen, device="cuda") * 1e-2).to(torch.bfloat16)
        for scale in (1.0, 37.5):
            qf = quantizer(scale)
            fused = tex.gelu(x, qf)
            fwd = {"Inductor fp32 gelu": ind_gelu(x.float()), "tex.gelu on fp32 copy": tex.gelu(x.float(), None),
                   "bf16 tex.gelu (no widening)": tex.gelu(x, None)}
            for name, y in fwd.items():
                q = quantizer(scale)
                out = q(y)
                diff = (out._data != fused._data).sum().item()
                print(f"gelu fwd | {rows} x {n} | {scale} | {name} | {diff} of {out._data.numel()} | "
                      f"{qf.amax.item():.8g} / {q.amax.item():.8g} | -", flush=True)
            qb = quantizer(scale, tex.DType.kFloat8E5M2, col=True)
            db_f, dact_f = tex.dbias_dgelu(g, x, qb)
            bwd = {"Inductor fp32 gelu_backward": ind_dgelu(g.float(), x.float()),
                   "tex.dgelu on fp32 copies": tex.dgelu(g.float(), x.float(), None),
                   "bf16 tex.dgelu (no widening)": tex.dgelu(g, x, None)}
            for name, d in bwd.items():
                q = quantizer(scale, tex.DType.kFloat8E5M2, col=True)
                db, out = tex.bgrad_quantize(d, q)
                diff = (out._data != dact_f._data).sum().item()
                ddb = (db.float() - db_f.float()).abs().max().item()
                print(f"gelu bwd | {rows} x {n} | {scale} | {name} | {diff} of {out._data.numel()} | "
                      f"{qb.amax.item():.8g} / {q.amax.item():.8g} | {ddb:.3g} ({db.dtype})", flush=True)
    @torch.compile
    def rebuild(x, w, b, mu, rs):  # widen_quantized_inputs' norm rule: TE's formula on TE's statistics
        y = rs.unsqueeze(-1) * (x.float() if mu is None else x.float() - mu.unsqueeze(-1))
        y = w.float() * y
        return y if b is None else y + b.float()

    for rms in (False, True):
        for rows, hidden in ((512, 512), (4096, 1024), (4096, 4096), (1000, 3000)):
            x = torch.randn(rows, hidden, generator=gen, device="cuda").to(torch.bfloat16) * 3 + 0.5
            w = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
            b = None if rms else (torch.randn(hidden, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)

            def norm(xx, ww, bb, q, otype):
                if rms:
                    return tex.rmsnorm_fwd(xx, ww, 1e-5, None, q, TE_DType[otype], 0, False)
                return tex.layernorm_fwd(xx, ww, bb, 1e-5, None, q, TE_DType[otype], 0, False)

            for scale in (1.0, 37.5):
                qf = quantizer(scale)
                fused = norm(x, w, b, qf, torch.bfloat16)[0]
                _, mu, rs = norm(x, w, b, None, torch.bfloat16)
                paths = {"stats of the bf16 kernel, y rebuilt (widen_quantized_inputs)": lambda: rebuild(
                             x, w, b, None if rms else mu, rs),
                         "bf16 in, fp32 out": lambda: norm(x, w, b, None, torch.float32)[0],
                         "fp32 copies (session 12's rule)": lambda: norm(
                             x.float(), w.float(), None if b is None else b.float(), None, torch.float32)[0]}
                what = f"{'rmsnorm' if rms else 'layernorm'} | {rows} x {hidden} | {scale} | "
                for name, path in paths.items():
                    try:
                        y = path()
                    except RuntimeError as e:  # TE has no kernel for bf16 in / fp32 out (common.h getKernel)
                        print(f"{what}{name} | unavailable: {str(e).splitlines()[0][-70:]} | - | -", flush=True)
                        continue
                    q = quantizer(scale)
                    out = q(y)
                    diff = (out._data != fused._data).sum().item()
                    print(f"{what}{name} | {diff} of {out._data.numel()} | {qf.amax.item():.8g} / "
                          f"{q.amax.item():.8g} | -", flush=True)

if __name__ == "__main__":
    main()
