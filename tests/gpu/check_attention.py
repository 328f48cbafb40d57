"""GPU check for the Triton paged-attention kernels (run by tests/gpu/run.sh on a CUDA machine).

1. Correctness: compiled kernels against the PyTorch reference over decode, prefill, chunked-prefill and
   mixed batches, GQA, fp32/fp16/bf16, block sizes 16 and 32.
2. Speed: the decode kernel's achieved KV-read bandwidth as a fraction of a measured device-copy ceiling,
   and the prefill kernel's time against torch's SDPA (flash) on the same, unpaged, tokens.

Needs only torch and triton (no pytest, no install): `PYTHONPATH=. python tests/gpu/check_attention.py`.
"""

from __future__ import annotations

import json
import sys

import torch

from runtimes.llm.attention import AttentionMetadata, paged_attention_ref, write_kv
from runtimes.llm.attention.triton_paged import paged_attention_triton

TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cuda")
    query = torch.randn(sum(query_lens), num_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return query, k_cache, v_cache, meta


def correctness() -> list[dict]:
    scenarios = {
        "decode": ([1] * 6, [1, 15, 16, 17, 300, 1025]),
        "prefill": ([7, 64, 200], [7, 64, 200]),
        "chunked": ([16, 100, 3], [40, 612, 50]),
        "mixed": ([1, 33, 1, 128], [77, 33, 500, 400]),
    }
    rows = []
    for name, (q_lens, s_lens) in scenarios.items():
        for block_size in (16, 32):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                q, kc, vc, meta = _case(q_lens, s_lens, block_size, 8, 2, 128, dtype)
                want = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, 0.088)
                got = paged_attention_triton(q, kc, vc, meta, 0.088).float()
                err = (got - want).abs().max().item()
                rows.append({"case": name, "block_size": block_size, "dtype": str(dtype), "max_abs_err": err,
                             "ok": err <= TOL[dtype]})
    # write_kv slots round-trip through the cache
    q, kc, vc, meta = _case([5, 1], [9, 30], 16, 8, 2, 128, torch.bfloat16)
    k_new = torch.randn(6, 2, 128, device="cuda", dtype=torch.bfloat16)
    write_kv(k_new, k_new, kc, vc, meta.slot_mapping)
    rows.append({"case": "write_kv", "ok": bool(torch.equal(kc.view(-1, 2, 128)[meta.slot_mapping], k_new))})
    return rows


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (ms / 1e3) / 1e9  # read + write


def decode_speed(ceiling_gbs: float) -> dict:
    batch, ctx, heads, kv_heads, dim = 64, 2048, 32, 8, 128
    q, kc, vc, meta = _case([1] * batch, [ctx] * batch, 16, heads, kv_heads, dim, torch.bfloat16)
    ms = _time_ms(lambda: paged_attention_triton(q, kc, vc, meta, dim**-0.5))
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
    gbs = kv_bytes / (ms / 1e3) / 1e9
    return {"decode_ms": ms, "kv_read_gbs": gbs, "copy_ceiling_gbs": ceiling_gbs, "fraction": gbs / ceiling_gbs}


def prefill_speed() -> dict:
    seq, heads, kv_heads, dim = 2048, 32, 8, 128
    q, kc, vc, meta = _case([seq], [seq], 16, heads, kv_heads, dim, torch.bfloat16)
    ours = _time_ms(lambda: paged_attention_triton(q, kc, vc, meta, dim**-0.5), iters=10)
    k = kc[meta.block_tables[0].long()].flatten(0, 1)[:seq].transpose(0, 1)
    v = vc[meta.block_tables[0].long()].flatten(0, 1)[:seq].transpose(0, 1)
    qt = q.transpose(0, 1)
    sdpa = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, k, v, is_causal=True, enable_gqa=True), iters=10)
    return {"prefill_ms": ours, "sdpa_flash_ms": sdpa, "ratio_ours_over_sdpa": ours / sdpa}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for a GPU machine", file=sys.stderr)
        return 2
    rows = correctness()
    for row in rows:
        print(json.dumps(row))
    ceiling = copy_bandwidth_gbs()
    print(json.dumps({"decode": decode_speed(ceiling)}))
    print(json.dumps({"prefill": prefill_speed()}))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
