"""GPU check of the Triton paged-attention kernels (run by tests/gpu/run.sh).

1. Correctness: the compiled attention kernels against the PyTorch reference over decode, prefill,
   chunked-prefill and mixed batches, GQA, fp32/fp16/bf16, block sizes 16 and 32. Cache slots no sequence owns
   hold NaN, so a kernel that reads a masked key fails loudly.
2. The Triton write-KV kernel (`write_kv_triton`) against the reference scatter (`write_kv`): every cache
   element equal, same and converting dtypes.
3. Speed: the decode kernel's KV-read bandwidth as a fraction of a measured device-copy ceiling, which must be at
   least `verdicts.DECODE_ATTENTION_FLOOR`, and the prefill kernel against torch's SDPA pinned to the flash backend
   on the same, unpaged, 4-D [batch, heads, seq, dim] tokens (its output is compared too, timing only reported).

Results agree within `verdicts.error_bound`: a few rounding steps of the dtype at the reference's magnitude plus a
small absolute term (a flat bound fails two correct bf16 results at values above 4).

`--device cpu` runs tiny shapes under Triton's interpreter, to try the script without a GPU: fp32, and bf16 only
where the interpreter can (it has no bf16 `tl.dot` and truncates fp32 -> bf16 where a GPU rounds). The decode speed
is then reported, not judged.
`PYTHONPATH=. python tests/gpu/check_attention.py [--device cpu]`.
"""

from __future__ import annotations

import os
import sys

from tests.gpu.common import Reporter, copy_bandwidth_gbs, fmt, parse_args, time_ms

ARGS = parse_args(__doc__ or "")
DEVICE = ARGS.device
# `@triton.jit` picks interpreter or compiler when the kernel module is imported: decide before importing it.
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtimes.llm.attention import AttentionMetadata, paged_attention_ref, write_kv  # noqa: E402
from runtimes.llm.attention.triton_paged import paged_attention_triton, write_kv_triton  # noqa: E402
from tests.gpu.verdicts import DECODE_ATTENTION_FLOOR, compare, decode_attention_verdict  # noqa: E402
from tests.runtimes.llm.paged_case import paged_case  # noqa: E402

NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

if DEVICE == "cuda":
    HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
    SCENARIOS = {
        "decode": ([1] * 6, [1, 15, 16, 17, 300, 1025]),
        "prefill": ([7, 64, 200], [7, 64, 200]),
        "chunked": ([16, 100, 3], [40, 612, 50]),
        "mixed": ([1, 33, 1, 128], [77, 33, 500, 400]),
    }
    BLOCK_SIZES = (16, 32)
    DTYPES = {name: (torch.float32, torch.float16, torch.bfloat16) for name in SCENARIOS}
else:  # the interpreter: small, and no bf16 tl.dot (the prefill kernel's path for block_size, head_dim >= 16)
    HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
    SCENARIOS = {
        "decode": ([1, 1, 1], [1, 17, 40]),
        "prefill": ([7, 20], [7, 20]),
        "chunked": ([8, 3], [20, 30]),
        "mixed": ([1, 9, 1], [13, 9, 30]),
    }
    BLOCK_SIZES = (16,)
    DTYPES = {name: (torch.float32, torch.bfloat16) if name == "decode" else (torch.float32,) for name in SCENARIOS}


def check_correctness(rep: Reporter) -> None:
    for name, (q_lens, s_lens) in SCENARIOS.items():
        for block_size in BLOCK_SIZES:
            for dtype in DTYPES[name]:
                case = f"{name}.bs{block_size}.{NAMES[dtype]}"
                rep.guarded(case, lambda q=q_lens, s=s_lens, b=block_size, d=dtype, c=case:
                            _one_case(rep, c, q, s, b, d))


def _one_case(rep: Reporter, case: str, q_lens: list[int], s_lens: list[int], block_size: int,
              dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta, valid = paged_case(q_lens, s_lens, block_size, HEADS, KV_HEADS, HEAD_DIM, dtype,
                                                      device=DEVICE)
    scale = HEAD_DIM**-0.5
    k_ref, v_ref = (torch.where(valid[:, :, None, None], c, 0).float() for c in (k_cache, v_cache))
    want = paged_attention_ref(query.float(), k_ref, v_ref, meta, scale)
    got = paged_attention_triton(query, k_cache, v_cache, meta, scale).float()
    agreement = compare(got, want, dtype)  # NaN (a masked slot was read) fails it
    rep.report(case, agreement.ok, fmt(max_abs_err=agreement.max_abs_err, err_over_bound=agreement.err_over_bound),
               max_abs_err=agreement.max_abs_err, err_over_bound=agreement.err_over_bound)


def check_write_kv(rep: Reporter) -> None:
    """The Triton scatter against the reference one, on clones of the same NaN-filled cache: every element equal
    (slots written and slots not), for a cache in its own dtype and a conversion into it."""
    q_lens, s_lens = SCENARIOS["mixed"]
    pairs = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float32)]
    if DEVICE == "cuda":  # Triton's interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest
        pairs.append((torch.bfloat16, torch.float32))
    for cache_dtype, input_dtype in pairs:
        case = f"write_kv.{NAMES[input_dtype]}_into_{NAMES[cache_dtype]}"

        def run(cache_dtype: torch.dtype = cache_dtype, input_dtype: torch.dtype = input_dtype,
                case: str = case) -> None:
            _, k_cache, v_cache, meta, _ = paged_case(q_lens, s_lens, 16, HEADS, KV_HEADS, HEAD_DIM, cache_dtype,
                                                      seed=7, device=DEVICE)
            gen = torch.Generator(device=DEVICE).manual_seed(3)
            key, value = (torch.randn(sum(q_lens), KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen).to(input_dtype)
                          for _ in range(2))
            k_want, v_want = k_cache.clone(), v_cache.clone()
            write_kv(key, value, k_want, v_want, meta.slot_mapping)
            write_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping)
            same = [int((~((a == b) | (a.isnan() & b.isnan()))).sum()) for a, b in ((k_cache, k_want),
                                                                                     (v_cache, v_want))]
            rep.report(case, same == [0, 0], fmt(k_mismatches=same[0], v_mismatches=same[1],
                                                 tokens=len(meta.slot_mapping)), mismatches=same)

        rep.guarded(case, run)


def _random_case(query_lens: list[int], seq_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Large random inputs made on the device (paged_case fills NaN slot by slot on the host: too slow here)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    query = torch.randn(sum(query_lens), heads, dim, device=DEVICE, dtype=dtype, generator=gen)
    return query, k_cache, v_cache, meta


def check_decode_speed(rep: Reporter) -> None:
    batch, ctx, heads, kv_heads, dim = (64, 2048, 32, 8, 128) if DEVICE == "cuda" else (4, 64, 4, 2, 16)
    ceiling = copy_bandwidth_gbs(DEVICE)
    q, kc, vc, meta = _random_case([1] * batch, [ctx] * batch, 16, heads, kv_heads, dim, torch.bfloat16)
    iters, reps = (50, 5) if DEVICE == "cuda" else (1, 1)
    ms = time_ms(lambda: paged_attention_triton(q, kc, vc, meta, dim**-0.5), DEVICE, iters, reps, warmup=2)
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
    gbs = kv_bytes / (ms / 1e3) / 1e9
    verdict = decode_attention_verdict(gbs, ceiling, DEVICE)
    rep.report("decode_speed", verdict.ok, fmt(decode_ms=ms, kv_read_gbs=gbs, copy_ceiling_gbs=ceiling,
                                               fraction=gbs / ceiling) + f" ({verdict.why})",
               batch=batch, context=ctx, decode_ms=ms, kv_read_gbs=gbs, copy_ceiling_gbs=ceiling,
               fraction=gbs / ceiling, floor_fraction=DECODE_ATTENTION_FLOOR, judged=verdict.judged)


def check_prefill_speed(rep: Reporter) -> None:
    """Our prefill kernel against SDPA's flash backend on the same tokens, 4-D as that backend requires (with 3-D
    inputs SDPA silently takes another backend). GQA natively when flash takes `enable_gqa`, else with the KV
    heads repeated beforehand (outside the timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, heads, kv_heads, dim = (2048, 32, 8, 128) if DEVICE == "cuda" else (64, 4, 2, 16)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter has no bf16 tl.dot
    q, kc, vc, meta = _random_case([seq], [seq], 16, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    iters, reps = (10, 5) if DEVICE == "cuda" else (1, 1)
    ours_ms = time_ms(lambda: paged_attention_triton(q, kc, vc, meta, scale), DEVICE, iters, reps, warmup=2)
    ours = paged_attention_triton(q, kc, vc, meta, scale)  # [S, H, D]
    table = meta.block_tables[0].long()
    k4 = kc[table].flatten(0, 1)[:seq].transpose(0, 1)[None]  # [1, KVH, S, D]
    v4 = vc[table].flatten(0, 1)[:seq].transpose(0, 1)[None]
    q4 = q.transpose(0, 1)[None]  # [1, H, S, D]
    gqa = "native"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no silent fallback: flash or an error
        try:
            flash = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
        except RuntimeError:
            gqa = "expanded"
            k4, v4 = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k4, v4))
            flash = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        flash_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                                  enable_gqa=gqa == "native"),
                           DEVICE, iters, reps, warmup=2)
    # both results are rounded to the dtype: the bound lets them be a few rounding steps apart (see verdicts.py)
    agreement = compare(ours, flash[0].transpose(0, 1), dtype)
    rep.report("prefill_vs_flash", agreement.ok,
               fmt(prefill_ms=ours_ms, sdpa_flash_ms=flash_ms, ratio_ours_over_flash=ours_ms / flash_ms,
                   max_abs_err=agreement.max_abs_err, err_over_bound=agreement.err_over_bound, gqa=gqa),
               seq=seq, heads=heads, kv_heads=kv_heads, head_dim=dim, dtype=NAMES[dtype], prefill_ms=ours_ms,
               sdpa_flash_ms=flash_ms, ratio_ours_over_flash=ours_ms / flash_ms,
               max_abs_err_vs_flash=agreement.max_abs_err, err_over_bound=agreement.err_over_bound, flash_gqa=gqa)


def main() -> int:
    rep = Reporter("attention", ARGS.out)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        rep.report("cuda_available", False, "torch sees no CUDA device")
        return rep.exit_code()
    check_correctness(rep)
    check_write_kv(rep)
    rep.guarded("decode_speed", lambda: check_decode_speed(rep))
    rep.guarded("prefill_vs_flash", lambda: check_prefill_speed(rep))
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
