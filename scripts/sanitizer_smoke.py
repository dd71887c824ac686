"""A short run of every CUDA kernel on small shapes, for compute-sanitizer (memcheck, racecheck).

Each op runs once per kernel family (decode v1/v2 and prefill in fp32 and fp16, so both
the SIMT and the tensor-core prefill kernels, reshape_and_cache, copy_blocks) and is
compared with pagedkv.reference; exits 1 on a mismatch. Small on purpose: under the
sanitizer every memory access is instrumented.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python scripts/sanitizer_smoke.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from pagedkv import ops, reference

# The emulation's case builders and tolerances, so that both runs check the kernels alike.
sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulation"))
from check_kernels import ATOL, make_tables  # noqa: E402


def tables_for(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    table, num_blocks = make_tables(seq_lens, block_size, gen, extra=2)
    return table.cuda(), num_blocks


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    err = (actual.float() - expected.float()).abs().max().item()
    ok = err <= 2 * ATOL[dtype]
    print(f"{name:<32} max abs diff {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def run(dtype: torch.dtype, gen: torch.Generator) -> bool:
    block_size, num_heads, num_kv_heads, head_size = 16, 8, 2, 128
    seq_lens = [1, 37, 300]
    tables, num_blocks = tables_for(seq_lens, block_size, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc = torch.randn(shape, generator=gen).to(dtype).cuda()
    vc = torch.randn(shape, generator=gen).to(dtype).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    scale = head_size**-0.5
    ok = True

    key = torch.randn(3, num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    slots = torch.tensor([5, -1, 2 * block_size + 3]).cuda()
    ek, ev = kc.clone(), vc.clone()
    reference.reshape_and_cache(key, key, ek, ev, slots)
    ops.reshape_and_cache(key, key, kc, vc, slots)
    ok &= check(f"reshape_and_cache {dtype}", kc, ek, dtype)

    query = torch.randn(3, num_heads, head_size, generator=gen).to(dtype).cuda()
    expected = reference.paged_attention(query, kc, vc, tables, lens, scale)
    out = torch.empty_like(query)
    ops.paged_attention_v1(out, query, kc, vc, tables, lens, scale, 300)
    ok &= check(f"paged_attention_v1 {dtype}", out, expected, dtype)
    parts = 2
    es = torch.empty(3, num_heads, parts, device="cuda")
    ml = torch.empty_like(es)
    tmp = torch.empty(3, num_heads, parts, head_size, dtype=dtype, device="cuda")
    ops.paged_attention_v2(out, es, ml, tmp, query, kc, vc, tables, lens, scale, 300, None, 256)
    ok &= check(f"paged_attention_v2 {dtype}", out, expected, dtype)

    q_lens = [1, 20, 70]
    qsl = torch.tensor([0, 1, 21, 91], dtype=torch.int32).cuda()
    pq = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype).cuda()
    pout = torch.empty_like(pq)
    ops.paged_prefill_attention(pout, pq, kc, vc, tables, qsl, lens, scale, max(q_lens), 300)
    expected = reference.paged_prefill_attention(pq, kc, vc, tables, qsl, lens, scale)
    ok &= check(f"paged_prefill_attention {dtype}", pout, expected, dtype)

    mapping = torch.tensor([[0, num_blocks - 1], [1, num_blocks - 2]])
    ek, ev = [kc.clone()], [vc.clone()]
    reference.copy_blocks(ek, ev, mapping)
    ops.copy_blocks([kc], [vc], mapping)
    ok &= check(f"copy_blocks {dtype}", kc, ek[0], dtype)
    return ok


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    ok = all([run(dtype, gen) for dtype in (torch.float32, torch.float16, torch.bfloat16)])
    torch.cuda.synchronize()
    print("sanitizer smoke:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
