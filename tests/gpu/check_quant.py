"""The weight-only quantized matmul (`runtimes/llm/quant/triton_matmul.py`) compiled on the GPU.

For Llama-3-8B's projection shapes (q|k|v 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096, down 4096 x 14336) in
Q8_0 and Q4_1, with bf16 activations:

* `<fmt>.<shape>.m<M>`: the kernel against the blocks dequantized in PyTorch and multiplied in fp32, max error
  <= 2e-2 x the result's std (bf16 inputs and output);
* `<fmt>.<shape>.speed`: the time of one call at M=1 against the floor of reading its packed weight once at the
  measured device copy bandwidth (`of_floor`), and against `F.linear` on the same weight in bf16 (reported). It
  fails over `verdicts.quant_limit_ms`: the weight read at `QUANT_FLOOR` of the copy bandwidth plus a launch
  allowance.

`--device cpu`: small shapes under Triton's interpreter, to try the script without a GPU; the speed is measured
once per shape and reported, not judged.
"""

from __future__ import annotations

import os
import sys

from tests.gpu.common import Reporter, copy_bandwidth_gbs, fmt, parse_args, time_ms

ARGS = parse_args(__doc__ or "")
DEVICE = ARGS.device
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtimes.llm.quant.formats import BLOCK, Q4_1, Q8_0, dequantize_rows, padded_blocks  # noqa: E402
from runtimes.llm.quant.triton_matmul import quant_matmul  # noqa: E402
from tests.gpu.verdicts import quant_limit_ms, quant_speed_verdict  # noqa: E402

SHAPES = ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
          if DEVICE == "cuda" else {"qkv": (96, 64), "down": (64, 160)})
BATCHES = (1, 16, 64) if DEVICE == "cuda" else (1, 5)


def random_blocks(fmt_, n: int, k: int) -> torch.Tensor:
    """Packed rows of random values, scales and offsets, made on the device (quantizing 200M values on the host
    would take most of the time this check has)."""
    blocks = padded_blocks(k)
    values = torch.randint(0, 256, (n, blocks * BLOCK * fmt_.bits // 8), dtype=torch.uint8, device=DEVICE)
    d = (torch.rand(n, blocks, device=DEVICE) * 0.01 + 1e-3).half().view(torch.uint8)
    c = (torch.randn(n, blocks, device=DEVICE) * 0.01).half().view(torch.uint8)
    return torch.cat((values, d, c), dim=1)


def check_shape(rep: Reporter, fmt_, name: str, n: int, k: int, bandwidth: float) -> None:
    packed = random_blocks(fmt_, n, k)
    dense = dequantize_rows(packed, fmt_, k)  # [N, K] fp32, on the device
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for m in BATCHES:
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        truth = x.float() @ dense.T
        got = quant_matmul(x, packed, fmt_, k).float()
        err = (got - truth).abs().max().item() / max(truth.std().item(), 1e-12)
        rep.report(f"{fmt_.name}.{name}.m{m}", err <= 2e-2, fmt(err_over_std=err), err_over_std=err)
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    bf16 = dense.to(dtype)
    timing = {"iters": 1, "reps": 1, "warmup": 1} if DEVICE == "cpu" else {}  # the interpreter: once, not judged
    ms = time_ms(lambda: quant_matmul(x, packed, fmt_, k), DEVICE, **timing)
    ms_bf16 = time_ms(lambda: F.linear(x, bf16), DEVICE, **timing)
    floor_ms = packed.numel() / (bandwidth * 1e9) * 1e3
    limit_ms = quant_limit_ms(packed.numel(), bandwidth)
    verdict = quant_speed_verdict(ms, packed.numel(), bandwidth, DEVICE)
    rep.report(f"{fmt_.name}.{name}.speed", verdict.ok,
               fmt(ms=ms, limit_ms=limit_ms, floor_ms=floor_ms, of_floor=floor_ms / ms, bf16_linear_ms=ms_bf16,
                   vs_bf16=ms_bf16 / ms) + f" ({verdict.why})",
               ms=ms, limit_ms=limit_ms, floor_ms=floor_ms, bf16_linear_ms=ms_bf16, weight_bytes=packed.numel(),
               copy_gbs=bandwidth, judged=verdict.judged)


def main() -> int:
    rep = Reporter("quant", ARGS.out)
    bandwidth = copy_bandwidth_gbs(DEVICE)
    for fmt_ in (Q8_0, Q4_1):
        for name, (n, k) in SHAPES.items():
            rep.guarded(f"{fmt_.name}.{name}",
                        lambda f=fmt_, nm=name, n=n, k=k: check_shape(rep, f, nm, n, k, bandwidth))
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
