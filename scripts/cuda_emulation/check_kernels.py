"""Check the CUDA kernels' logic on a machine without a GPU, by emulation.

Compiles csrc/attention/*.cu and csrc/cache/cache_kernels.cu as host C++ against
emu.h (one std::thread per CUDA thread, barriers for __syncthreads, an exchange
buffer for warp shuffles), then runs small cases through the real launchers and
compares with pagedkv.reference. It checks indexing, masking, partition bounds
and reductions, not speed; the GPU tests (tests/test_cuda.py) remain the
authority.

    python scripts/cuda_emulation/check_kernels.py [--quick] [--quant-only]

Every quantized kv_cache_dtype is covered too (run_quant): the cache writers'
codes and (scale, zero) planes bit for bit against reference.quantize_kv, block
copies of codes and planes, and decode v1/v2 and prefill reading them.

Needs g++ (C++20) and the CUDA headers (CUDA_HOME, default /usr/local/cuda); no
GPU and no built pagedkv extension.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KERNELS = [
    "attention/paged_attention.cu",
    "attention/prefill_attention.cu",
    "cache/cache_kernels.cu",
    "fused/fused_kernels.cu",
]
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# KVCacheDType of csrc/common/kv_cache_dtype.h.
FORMAT_CODE = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8_per_token_head": 3, "int4_per_token_head": 4}
QUANT_FORMATS = [f for f in FORMAT_CODE if f != "auto"]
ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def load_reference():
    spec = importlib.util.spec_from_file_location(
        "reference", ROOT / "python/pagedkv/reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The launchers store and read the codes of the rows they are given: int4's row rotation belongs to the
    # op wrappers (csrc/common/row_rotation.h, not compiled here), so the kernels are held to the reference's
    # rule without it. tests/test_cuda.py checks the ops, rotation included, on a GPU.
    module.rotates_rows = lambda kv_cache_dtype: False
    return module


def build(build_dir: Path) -> ctypes.CDLL:
    """Rewrites kernel launches as emu::launch calls and compiles a shared library."""
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [HERE / "harness.cpp"]
    for rel in KERNELS:
        text = (ROOT / "csrc" / rel).read_text()
        text = re.sub(
            r"([\w:]+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);",
            r"emu::launch(\1, \2, \3);",
            text,
            flags=re.DOTALL,
        )
        text = text.replace(
            "extern __shared__ float4 smem_f4[];",
            "float4* smem_f4 = emu::dynamic_smem<float4>();",
        )
        out = build_dir / (Path(rel).stem + ".cpp")
        out.write_text('#include "emu.h"\n' + text)
        sources.append(out)
    lib = build_dir / "libpagedkv_emu.so"
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cmd = [
        "g++",
        "-std=c++20",
        "-O2",
        "-fno-strict-aliasing",
        "-fPIC",
        "-shared",
        "-w",
        f"-I{HERE}",
        f"-I{ROOT / 'csrc'}",
        f"-I{cuda_home}/include",
        *map(str, sources),
        "-o",
        str(lib),
        "-lpthread",
    ]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def bind(lib: ctypes.CDLL) -> None:
    p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib.emu_decode.argtypes = [
        i,
        i,
        p,
        p,
        ll,
        ll,
        p,
        p,
        p,
        p,
        i,
        i,
        i,
        i,
        i,
        p,
        f,
        i,
        i,
        p,
        p,
        p,
        i,
        i,
        i,
        i,
        f,
    ]
    lib.emu_prefill.argtypes = [
        i,
        p,
        p,
        ll,
        ll,
        p,
        p,
        p,
        p,
        i,
        i,
        i,
        i,
        i,
        p,
        f,
        i,
        i,
        i,
        i,
        i,
        f,
    ]
    lib.emu_reshape.argtypes = [p, p, ll, ll, ll, ll, p, p, p, ll, ll, i, i, i, i]
    lib.emu_set_kv_format.argtypes = [i, p, p, p, p]
    lib.emu_copy_blocks.argtypes = [p, i, p, ll, ll, ll]
    lib.emu_rms_norm.argtypes = [i, p, ll, p, ll, p, ll, p, ll, i, f]
    lib.emu_rotary_cache.argtypes = [i, p, p, ll, ll, p, ll, ll, p, ll, ll, p, p, p, p, ll, i, ll, i, i, i, ll, i]


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def make_tables(seq_lens, block_size, gen, extra=3):
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(per_seq) + extra
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for s, n in enumerate(per_seq):
        table[s, :n] = perm[start : start + n].int()
        start += n
    return table, num_blocks


class Checker:
    def __init__(self, lib, ref):
        self.lib, self.ref, self.cases = lib, ref, 0

    @contextlib.contextmanager
    def kv_format(self, op_args):
        """The launches inside run with the cache format of op_args (quantize_cache's; {}: auto)."""
        if not op_args:
            yield
            return
        fmt = op_args["kv_cache_dtype"]
        ks, vs = op_args["k_scale"], op_args["v_scale"]
        per_token = fmt.endswith("per_token_head")
        self.lib.emu_set_kv_format(FORMAT_CODE[fmt], None if per_token else ptr(ks), None if per_token else ptr(vs),
                                   ptr(ks) if per_token else None, ptr(vs) if per_token else None)
        try:
            yield
        finally:
            self.lib.emu_set_kv_format(0, None, None, None, None)

    def quantize_cache(self, kc, vc, kv_cache_dtype, fp8_scales=(0.02, 0.5)):
        """(key codes, value codes, op_args) of float caches in a quantized format (auto: as they are, {}).
        fp8_scales: the per-tensor k/v scales (None: no scale tensors, read as 1.0)."""
        if kv_cache_dtype == "auto":
            return kc, vc, {}
        fp8 = kv_cache_dtype.startswith("fp8")
        if fp8:
            ks, vs = ((torch.tensor([fp8_scales[0]]), torch.tensor([fp8_scales[1]])) if fp8_scales is not None
                      else (None, None))
            kq, _ = self.ref.quantize_kv(kc, kv_cache_dtype, ks)
            vq, _ = self.ref.quantize_kv(vc, kv_cache_dtype, vs)
        else:
            kq, ks = self.ref.quantize_kv(kc, kv_cache_dtype)
            vq, vs = self.ref.quantize_kv(vc, kv_cache_dtype)
        return kq.contiguous(), vq.contiguous(), {"kv_cache_dtype": kv_cache_dtype, "k_scale": ks, "v_scale": vs}

    def close(self, actual, expected, dtype, what):
        torch.testing.assert_close(
            actual.float(),
            expected.float(),
            atol=ATOL[dtype],
            rtol=ATOL[dtype],
            msg=what,
        )
        self.cases += 1

    def decode(
        self,
        version,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        *,
        alibi=False,
        partition_size=256,
        strided=False,
        seed=0,
        max_seq_len=None,
        window=0,
        soft_cap=0.0,
        kv_cache_dtype="auto",
        fp8_scales=(0.02, 0.5),
    ):
        """max_seq_len: what the launcher is told (default: the true maximum); a smaller
        value is the lie that skipped index checks let through: v2 must still attend
        every token of every sequence, not drop the partitions past max_seq_len."""
        gen = torch.Generator().manual_seed(seed)
        tables, num_blocks = make_tables(seq_lens, block_size, gen)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        kc, vc = (
            torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype),
        )
        kc, vc, op_args = self.quantize_cache(kc, vc, kv_cache_dtype, fp8_scales)
        n = len(seq_lens)
        if strided:  # query as a slice of a bigger projection
            query = torch.randn(n, 2, num_heads, head_size, generator=gen).to(dtype)[
                :, 1
            ]
        else:
            query = torch.randn(n, num_heads, head_size, generator=gen).to(dtype)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        slopes = (
            torch.tensor(
                [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
            )
            if alibi
            else None
        )
        scale = head_size**-0.5
        out = torch.full((n, num_heads, head_size), 7.0).to(dtype)
        max_len = max(seq_lens) if max_seq_len is None else max_seq_len
        parts = (
            max_len + partition_size - 1
        ) // partition_size + 1  # one spare: must stay unread
        exp_sums = torch.full((n, num_heads, parts), float("nan"))
        max_logits = exp_sums.clone()
        tmp_out = torch.full((n, num_heads, parts, head_size), float("nan")).to(dtype)
        with self.kv_format(op_args):
            rc = self.lib.emu_decode(
            version,
            DTYPE_CODE[dtype],
            ptr(out),
            ptr(query),
            out.stride(0),
            query.stride(0),
            ptr(kc),
            ptr(vc),
            ptr(tables),
            ptr(lens),
            num_blocks,
            block_size,
            num_kv_heads,
            head_size,
            tables.shape[1],
            ptr(slopes),
            scale,
            n,
            num_heads,
            ptr(exp_sums),
            ptr(max_logits),
            ptr(tmp_out),
            parts,
            partition_size,
            max_len,
            window,
            soft_cap,
        )
        assert rc == 0, f"launcher returned {rc}"
        expected = self.ref.paged_attention(query, kc, vc, tables, lens, scale, slopes, window, soft_cap, **op_args)
        self.close(
            out,
            expected,
            dtype,
            f"decode v{version} {dtype} d={head_size} bs={block_size} "
            f"heads={num_heads}/{num_kv_heads} max_seq_len={max_len} window={window} cap={soft_cap} "
            f"kv_cache_dtype={kv_cache_dtype}",
        )

    def decode_bad_block(self):
        """An out-of-range block id is masked, never read: V = 1 everywhere gives exactly 1."""
        kc = torch.randn(6, 16, 2, 64)
        vc = torch.ones(6, 16, 2, 64)
        query = torch.randn(2, 4, 64)
        tables = torch.tensor([[0, 1 << 30, 2], [3, -7, 4]], dtype=torch.int32)
        lens = torch.tensor([40, 20], dtype=torch.int32)
        for version in (1, 2):
            out = torch.zeros_like(query)
            es, ml, tmp = (
                torch.empty(2, 4, 1),
                torch.empty(2, 4, 1),
                torch.empty(2, 4, 1, 64),
            )
            rc = self.lib.emu_decode(
                version,
                0,
                ptr(out),
                ptr(query),
                out.stride(0),
                query.stride(0),
                ptr(kc),
                ptr(vc),
                ptr(tables),
                ptr(lens),
                6,
                16,
                2,
                64,
                3,
                None,
                0.1,
                2,
                4,
                ptr(es),
                ptr(ml),
                ptr(tmp),
                1,
                256,
                40,
                0,
                0.0,
            )
            assert rc == 0
            self.close(
                out, torch.ones_like(out), torch.float32, f"bad block id, v{version}"
            )

    def window_freed_blocks(self, dtype):
        """Blocks wholly before the window hold NaN and -1 / out-of-range ids: never read (v1, v2, prefill)."""
        window, bs = 20, 16
        kc = torch.randn(10, bs, 2, 64).to(dtype)
        vc = torch.randn(10, bs, 2, 64).to(dtype)
        query = torch.randn(2, 4, 64).to(dtype)
        clean = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
        lens = torch.tensor([70, 40], dtype=torch.int32)  # windows: keys 50..69 and 20..39
        expected = self.ref.paged_attention(query, kc, vc, clean, lens, 0.1, None, window, 2.0)
        tables = clean.clone()
        for s, first in enumerate((50, 20)):
            for b in range(first // bs):
                kc[int(clean[s, b])] = float("nan")
                vc[int(clean[s, b])] = float("nan")
                tables[s, b] = -1 if b % 2 else 1 << 20
        for version in (1, 2):
            out = torch.zeros_like(query)
            parts = 2
            es, ml = torch.full((2, 4, parts), float("nan")), torch.full((2, 4, parts), float("nan"))
            tmp = torch.full((2, 4, parts, 64), float("nan")).to(dtype)
            rc = self.lib.emu_decode(version, DTYPE_CODE[dtype], ptr(out), ptr(query), out.stride(0), query.stride(0),
                                     ptr(kc), ptr(vc), ptr(tables), ptr(lens), 10, bs, 2, 64, 5, None, 0.1, 2, 4,
                                     ptr(es), ptr(ml), ptr(tmp), parts, 256 if version == 2 else 256, 70, window, 2.0)
            assert rc == 0 and torch.isfinite(out.float()).all(), f"window decode v{version} read a freed block"
            self.close(out, expected, dtype, f"window decode v{version} with freed blocks, {dtype}")
        qp = torch.randn(5, 4, 64).to(dtype)
        qsl = torch.tensor([0, 3, 5], dtype=torch.int32)  # first new tokens at 67 and 38: keys from 48 and 19
        expected = self.ref.paged_prefill_attention(qp, kc, vc, clean, qsl, lens, 0.1, window, 2.0)
        out = torch.zeros_like(qp)
        rc = self.lib.emu_prefill(DTYPE_CODE[dtype], ptr(out), ptr(qp), out.stride(0), qp.stride(0), ptr(kc), ptr(vc),
                                  ptr(tables), ptr(lens), 10, bs, 2, 64, 5, ptr(qsl), 0.1, 2, 4, 5, 3, window, 2.0)
        assert rc == 0 and torch.isfinite(out.float()).all(), "window prefill read a freed block"
        self.close(out, expected, dtype, f"window prefill with freed blocks, {dtype}")

    def prefill_bad_block(self, dtype):
        """Out-of-range block ids in prefill are masked, never read: V = 1 gives exactly 1."""
        kc = torch.randn(6, 16, 2, 64).to(dtype)
        vc = torch.ones(6, 16, 2, 64).to(dtype)
        query = torch.randn(3, 4, 64).to(dtype)
        tables = torch.tensor([[0, 1 << 30, 2], [3, -7, 4]], dtype=torch.int32)
        lens = torch.tensor([40, 20], dtype=torch.int32)
        qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
        out = torch.zeros_like(query)
        rc = self.lib.emu_prefill(DTYPE_CODE[dtype], ptr(out), ptr(query), out.stride(0), query.stride(0), ptr(kc),
                                  ptr(vc), ptr(tables), ptr(lens), 6, 16, 2, 64, 3, ptr(qsl), 0.1, 2, 4, 3, 2, 0, 0.0)
        assert rc == 0
        self.close(out, torch.ones_like(out), dtype, f"prefill bad block id, {dtype}")

    def prefill(
        self,
        q_lens,
        ctx_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        seed=0,
        max_query_len=None,
        odd_stride=False,
        window=0,
        soft_cap=0.0,
        kv_cache_dtype="auto",
    ):
        """max_query_len: what the launcher is told (default: the true maximum); a smaller
        value (index checks off) must still produce every row (fp16/bf16: the tensor-core
        kernel strides over query tiles)."""
        gen = torch.Generator().manual_seed(seed)
        seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
        tables, num_blocks = make_tables(seq_lens, block_size, gen)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        kc, vc = (
            torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype),
        )
        kc, vc, op_args = self.quantize_cache(kc, vc, kv_cache_dtype)
        num_tokens = sum(q_lens)
        query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        out = torch.full((num_tokens, num_heads, head_size), 7.0).to(dtype)
        if odd_stride:  # rows one element apart from the 16-byte grid: the unaligned paths
            row = num_heads * head_size + 1
            q_buf = torch.zeros(num_tokens * row + 1, dtype=dtype)
            query_view = q_buf.as_strided(query.shape, (row, head_size, 1), 1)
            query_view.copy_(query)
            query = query_view
            out = torch.full((num_tokens * row + 1,), 7.0).to(dtype).as_strided(out.shape, (row, head_size, 1), 1)
        scale = head_size**-0.5
        with self.kv_format(op_args):
            rc = self.lib.emu_prefill(
            DTYPE_CODE[dtype],
            ptr(out),
            ptr(query),
            out.stride(0),
            query.stride(0),
            ptr(kc),
            ptr(vc),
            ptr(tables),
            ptr(lens),
            num_blocks,
            block_size,
            num_kv_heads,
            head_size,
            tables.shape[1],
            ptr(qsl),
            scale,
            len(q_lens),
            num_heads,
            num_tokens,
            max(q_lens) if max_query_len is None else max_query_len,
            window,
            soft_cap,
        )
        assert rc == 0, f"launcher returned {rc}"
        expected = self.ref.paged_prefill_attention(
            query, kc, vc, tables, qsl, lens, scale, window, soft_cap, **op_args
        )
        self.close(
            out,
            expected,
            dtype,
            f"prefill {dtype} d={head_size} bs={block_size} "
            f"heads={num_heads}/{num_kv_heads} window={window} cap={soft_cap} kv_cache_dtype={kv_cache_dtype}",
        )

    def cache_ops(self, dtype, head_size, strided):
        gen = torch.Generator().manual_seed(head_size)
        num_tokens, num_kv_heads, block_size, num_blocks = 21, 3, 8, 6
        if strided:  # key/value as slices of a fused projection
            fused = torch.randn(
                num_tokens, 3, num_kv_heads, head_size, generator=gen
            ).to(dtype)
            key, value = fused[:, 1], fused[:, 2]
        else:
            key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(
                dtype
            )
            value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(
                dtype
            )
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::5] = -1
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        kc, vc = (
            torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype),
        )
        ek, ev = kc.clone(), vc.clone()
        self.ref.reshape_and_cache(key, value, ek, ev, slots)
        rc = self.lib.emu_reshape(
            ptr(key),
            ptr(value),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            ptr(kc),
            ptr(vc),
            ptr(slots),
            num_tokens,
            num_blocks * block_size,
            num_kv_heads,
            head_size,
            kc.element_size(),
            DTYPE_CODE[dtype],
        )
        assert rc == 0 and torch.equal(kc, ek) and torch.equal(vc, ev), (
            "reshape_and_cache"
        )
        layers = [
            (
                torch.randn(shape, generator=gen).to(dtype),
                torch.randn(shape, generator=gen).to(dtype),
            )
            for _ in range(2)
        ]
        ptrs = torch.tensor(
            [k.data_ptr() for k, _ in layers] + [v.data_ptr() for _, v in layers]
        )
        mapping = torch.tensor([[0, 3], [1, 4], [5, 0]])
        ek, ev = [k.clone() for k, _ in layers], [v.clone() for _, v in layers]
        self.ref.copy_blocks(ek, ev, mapping)
        rc = self.lib.emu_copy_blocks(
            ptr(ptrs), 2, ptr(mapping), 3, kc.stride(0) * kc.element_size(), num_blocks
        )
        assert rc == 0
        for (k, v), k_exp, v_exp in zip(layers, ek, ev, strict=True):
            assert torch.equal(k, k_exp) and torch.equal(v, v_exp), "copy_blocks"
        self.cases += 2


    @staticmethod
    def quant_rows(gen, shape, dtype):
        """K/V rows with the values a quantizer must get right: random rows, constant rows (scale 0),
        rows past the fp8 and fp16 ranges (saturation, clamped pairs), tiny ones (subnormal codes)."""
        x = torch.randn(shape, generator=gen) * 3
        x[0] = 1.25                     # every row of token 0 constant
        x[1] *= 4000.0                  # past e4m3's 448 after the scale, not past 57344
        x[2, 0] = torch.linspace(-7e4, 9e4, shape[-1])  # past fp16's 65504: clamped (scale, zero)
        x[3] *= 1e-5                    # subnormal fp8 codes
        return x.to(dtype)

    def quant_cache_write(self, dtype, head_size, kv_cache_dtype, strided, rotary=False, fp8_scales=(0.37, 2.5)):
        """reshape_and_cache (or rotary_embedding_and_cache) into a quantized cache: codes and planes bit for
        bit those of reference.quantize_kv of the rows written, untouched slots unchanged."""
        gen = torch.Generator().manual_seed(head_size + FORMAT_CODE[kv_cache_dtype])
        num_tokens, nkv, nh, block_size, num_blocks = 21, 3, 6, 8, 6
        fmt = self.ref.kv_cache_format(kv_cache_dtype)
        width = (nh + 2 * nkv) if rotary else 3
        fused = self.quant_rows(gen, (num_tokens, width, nkv if not rotary else 1, head_size), dtype)
        if rotary or strided:  # key/value as slices of a fused projection
            flat = fused.reshape(num_tokens, -1, head_size)
            q = flat[:, :nh] if rotary else None
            key = flat[:, nh : nh + nkv] if rotary else fused[:, 1]
            value = flat[:, nh + nkv :] if rotary else fused[:, 2]
        else:
            key, value = fused[:, 1].clone(), fused[:, 2].clone()
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::5] = -1
        shape = (num_blocks, block_size, nkv, fmt.last_dim(head_size))
        kc = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        vc = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        if fmt.per_token_scale:
            ks = torch.randn(num_blocks, block_size, nkv, 2, generator=gen).half()
            vs = torch.randn(num_blocks, block_size, nkv, 2, generator=gen).half()
        elif fp8_scales is not None:
            ks, vs = torch.tensor([fp8_scales[0]]), torch.tensor([fp8_scales[1]])
        else:
            ks = vs = None
        if fmt.is_fp8:
            kc, vc = kc.view(fmt.element), vc.view(fmt.element)
        ek, ev = kc.clone(), vc.clone()
        eks, evs = (ks.clone(), vs.clone()) if fmt.per_token_scale else (ks, vs)
        op_args = {"kv_cache_dtype": kv_cache_dtype, "k_scale": ks, "v_scale": vs}
        with self.kv_format(op_args):
            if rotary:
                max_pos, rot_dim = 64, head_size
                inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
                freqs = torch.outer(torch.arange(max_pos).float(), inv)
                cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
                positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
                rc = self.lib.emu_rotary_cache(DTYPE_CODE[dtype], ptr(positions), ptr(q), q.stride(0), q.stride(1),
                                               ptr(key), key.stride(0), key.stride(1), ptr(value), value.stride(0),
                                               value.stride(1), ptr(kc), ptr(vc), ptr(slots), ptr(cos_sin), max_pos,
                                               rot_dim, num_tokens, nh, nkv, head_size, num_blocks * block_size, 1)
            else:
                rc = self.lib.emu_reshape(ptr(key), ptr(value), key.stride(0), key.stride(1), value.stride(0),
                                          value.stride(1), ptr(kc), ptr(vc), ptr(slots), num_tokens,
                                          num_blocks * block_size, nkv, head_size, kc.element_size(),
                                          DTYPE_CODE[dtype])
        assert rc == 0, f"launcher returned {rc}"
        # The kernel's own rotated key is the input of the quantizer (rotation is checked by fused_rotary).
        self.ref.reshape_and_cache(key, value, ek, ev, slots, kv_cache_dtype, eks, evs)
        op = "rotary_embedding_and_cache" if rotary else "reshape_and_cache"
        what = f"{op} {kv_cache_dtype} {dtype} d={head_size}"
        for actual, want in ((kc, ek), (vc, ev)):
            assert torch.equal(actual.view(torch.uint8), want.view(torch.uint8)), f"{what}: codes differ"
        if fmt.per_token_scale:
            for actual, want in ((ks, eks), (vs, evs)):
                assert torch.equal(actual.view(torch.int16), want.view(torch.int16)), f"{what}: scale planes differ"
        self.cases += 1

    def copy_quant_blocks(self, kv_cache_dtype, head_size, num_kv_heads, block_size):
        """copy_blocks of 1-byte caches (int4: half the last dim) and their [.., 2] fp16 planes, which are
        small blocks whose size is not always a multiple of 16 bytes."""
        gen = torch.Generator().manual_seed(head_size + num_kv_heads)
        fmt = self.ref.kv_cache_format(kv_cache_dtype)
        num_blocks = 7
        shape = (num_blocks, block_size, num_kv_heads, fmt.last_dim(head_size))
        values = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(4)]
        planes = [torch.randn(num_blocks, block_size, num_kv_heads, 2, generator=gen).half() for _ in range(4)]
        mapping = torch.tensor([[0, 3], [1, 4], [6, 0]])
        for group in (values, planes):
            expected = [t.clone() for t in group]
            self.ref.copy_blocks(expected[:2], expected[2:], mapping)
            ptrs = torch.tensor([t.data_ptr() for t in group])  # layers 0, 1 keys, then values
            block_bytes = group[0].stride(0) * group[0].element_size()
            rc = self.lib.emu_copy_blocks(ptr(ptrs), 2, ptr(mapping), 3, block_bytes, num_blocks)
            assert rc == 0 and all(torch.equal(a, b) for a, b in zip(group, expected, strict=True)), (
                f"copy_blocks {kv_cache_dtype} block_bytes={block_bytes}")
        self.cases += 1

    def fused_norm(self, dtype, num_tokens, hidden, with_residual):
        """rms_norm / fused_add_rms_norm (out = input, in place) vs the reference."""
        gen = torch.Generator().manual_seed(hidden + num_tokens)
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        res = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype)
        w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        if with_residual:
            exp_out, exp_res = self.ref.fused_add_rms_norm(x, res, w, 1e-6)
            rc = self.lib.emu_rms_norm(DTYPE_CODE[dtype], ptr(x), x.stride(0), ptr(x), x.stride(0), ptr(res),
                                       res.stride(0), ptr(w), num_tokens, hidden, 1e-6)
            assert rc == 0 and torch.equal(res, exp_res), f"fused_add_rms_norm residual {dtype} hidden={hidden}"
            out = x
        else:
            exp_out = self.ref.rms_norm(x, w, 1e-6)
            out = torch.full_like(x, 7.0)
            rc = self.lib.emu_rms_norm(DTYPE_CODE[dtype], ptr(out), out.stride(0), ptr(x), x.stride(0), None, 0,
                                       ptr(w), num_tokens, hidden, 1e-6)
            assert rc == 0
        torch.testing.assert_close(out, exp_out, **FUSED_TOL[dtype], msg=f"rms_norm {dtype} hidden={hidden}")
        self.cases += 1

    def fused_rotary(self, dtype, num_tokens, head_size, is_neox, rot_dim=None):
        """rotary_embedding_and_cache on strided q/k/v views of one projection vs the reference."""
        gen = torch.Generator().manual_seed(head_size * 7 + num_tokens)
        nh, nkv, block_size, max_pos = 9, 3, 16, 512
        rot_dim = rot_dim or head_size
        half = rot_dim // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
        freqs = torch.outer(torch.arange(max_pos).float(), inv)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
        assert cos_sin.shape[1] == 2 * half
        qkv = torch.randn(num_tokens, (nh + 2 * nkv) * head_size, generator=gen).to(dtype)
        q = qkv[:, : nh * head_size].view(num_tokens, nh, head_size)
        k = qkv[:, nh * head_size : (nh + nkv) * head_size].view(num_tokens, nkv, head_size)
        v = qkv[:, (nh + nkv) * head_size :].view(num_tokens, nkv, head_size)
        num_blocks = num_tokens // block_size + 2
        kc = torch.randn(num_blocks, block_size, nkv, head_size, generator=gen).to(dtype)
        vc = torch.randn_like(kc)
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::4] = -1
        eq, ek, ekc, evc = q.clone(), k.clone(), kc.clone(), vc.clone()
        self.ref.rotary_embedding_and_cache(positions, eq, ek, v, ekc, evc, slots, cos_sin, is_neox)
        rc = self.lib.emu_rotary_cache(DTYPE_CODE[dtype], ptr(positions), ptr(q), q.stride(0), q.stride(1), ptr(k),
                                       k.stride(0), k.stride(1), ptr(v), v.stride(0), v.stride(1), ptr(kc), ptr(vc),
                                       ptr(slots), ptr(cos_sin), max_pos, rot_dim, num_tokens, nh, nkv, head_size,
                                       num_blocks * block_size, int(is_neox))
        assert rc == 0
        what = f"rotary_embedding_and_cache {dtype} d={head_size} neox={is_neox}"
        for actual, want in ((q, eq), (k, ek), (kc, ekc), (vc, evc)):
            torch.testing.assert_close(actual, want, **FUSED_TOL[dtype], msg=what)
        self.cases += 1


# The fused ops round the same values as the reference; 16-bit results may differ by one ulp.
FUSED_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}


def run_fused(checker: Checker) -> None:
    for dtype in DTYPE_CODE:
        for num_tokens, hidden in itertools.product((1, 3, 33), (1, 7, 576, 1000)):
            checker.fused_norm(dtype, num_tokens, hidden, with_residual=num_tokens != 3)
        checker.fused_norm(dtype, 3, 1000, with_residual=True)
        for head_size, is_neox in itertools.product((64, 80, 256), (True, False)):
            checker.fused_rotary(dtype, 33 if head_size == 64 else 3, head_size, is_neox)
        checker.fused_rotary(dtype, 5, 128, True, rot_dim=64)
    print("  fused ops: ok", flush=True)


def run(checker: Checker, quick: bool, dtypes=None, head_sizes=None) -> None:
    dtypes = dtypes or ([torch.float16] if quick else list(DTYPE_CODE))
    head_sizes = head_sizes or ([64, 80, 128, 256] if quick else [64, 80, 96, 112, 128, 256])
    # (num_heads, num_kv_heads): G = 1, 2, 3 (rounded up to 4), 8, 12 (two chunks of 6), 64 (MQA).
    groups = (
        [(2, 2), (8, 1)]
        if quick
        else [(2, 2), (6, 3), (3, 1), (8, 1), (12, 1), (64, 1)]
    )
    for dtype, head_size in itertools.product(dtypes, head_sizes):
        for n, (num_heads, num_kv_heads) in enumerate(groups):
            block_size = [8, 16, 32][(head_size // 16 + n) % 3]
            for version in (1, 2):
                checker.decode(
                    version,
                    [0, 1, 37, 300],
                    num_heads,
                    num_kv_heads,
                    head_size,
                    block_size,
                    dtype,
                    alibi=num_heads % 3 == 0,
                    strided=head_size == 96,
                    seed=head_size + num_heads,
                )
            checker.prefill(
                [37, 70, 1, 0],
                [0, 45, 100, 9],
                num_heads,
                num_kv_heads,
                head_size,
                block_size,
                dtype,
                seed=head_size + n,
            )
        print(f"  {dtype} head_size={head_size}: ok", flush=True)
    checker.decode(
        2,
        [1, 1100, 513],
        8,
        2,
        64,
        8,
        torch.bfloat16,
        alibi=True,
        partition_size=512,
        seed=1,
    )
    checker.prefill(
        [130, 3], [0, 200], 96, 1, 64, 16, torch.float16
    )  # G > rows per CTA: head chunks
    checker.prefill(
        [33, 2], [40, 31], 6, 2, 256, 16, torch.bfloat16, seed=2
    )  # head_size 256 (2 keys per thread in S = Q K^T), G = 3: unused rows in every tile
    checker.decode(
        2, [512, 0, 257], 6, 2, 256, 16, torch.float16, partition_size=256, seed=3
    )  # a partition-multiple length, an empty sequence and a 1-token last partition
    # seq_lens above max_seq_len (index checks off): the last partition takes the tail.
    checker.decode(2, [700, 1300, 90], 4, 2, 64, 16, torch.float16, partition_size=256, max_seq_len=500, seed=4)
    checker.decode(2, [40, 300], 4, 4, 128, 8, torch.float32, partition_size=256, max_seq_len=0, seed=5)
    # Tensor-core prefill: q_len above max_query_len, GQA 5 and 7 (odd row packing), bf16.
    checker.prefill([150, 2], [5, 60], 8, 2, 64, 16, torch.float16, seed=6, max_query_len=40)
    checker.prefill([150, 2], [5, 60], 8, 2, 64, 16, torch.float32, seed=6, max_query_len=40)
    checker.prefill([19, 33], [70, 0], 10, 2, 112, 8, torch.bfloat16, seed=7)
    checker.prefill([9, 40], [31, 17], 7, 1, 80, 32, torch.float16, seed=8)
    checker.prefill([9, 40], [31, 17], 4, 2, 64, 16, torch.bfloat16, seed=9, odd_stride=True)
    checker.decode(1, [5, 77, 300], 10, 2, 96, 8, torch.bfloat16, seed=9)  # GQA 5
    checker.decode(2, [5, 77, 600], 7, 1, 112, 16, torch.float16, partition_size=256, seed=10)  # GQA 7
    checker.decode_bad_block()
    for dtype in DTYPE_CODE:
        checker.prefill_bad_block(dtype)
    run_window(checker, quick)
    for dtype, head_size, strided in itertools.product(
        DTYPE_CODE, (64, 80, 256), (False, True)
    ):
        checker.cache_ops(dtype, head_size, strided)


def run_quant(checker: Checker, quick: bool) -> None:
    """Quantized KV caches (kv_cache_dtype): the writers bit for bit against reference.quantize_kv, block copies
    of codes and planes, and decode v1/v2 / prefill against the reference reading the same codes."""
    dtypes = [torch.float16] if quick else list(DTYPE_CODE)
    for fmt in QUANT_FORMATS:
        for dtype, head_size in itertools.product(DTYPE_CODE, (64, 80, 256)):
            checker.quant_cache_write(dtype, head_size, fmt, strided=head_size == 80)
        checker.quant_cache_write(torch.bfloat16, 128, fmt, strided=False, fp8_scales=None)
        checker.quant_cache_write(torch.float16, 64, fmt, strided=True, rotary=True)
        checker.quant_cache_write(torch.float32, 80, fmt, strided=True, rotary=True)
        checker.copy_quant_blocks(fmt, 64, 1, 8)
        checker.copy_quant_blocks(fmt, 80, 3, 16)
    print("  quantized cache writes / copies: ok", flush=True)
    # Quick: 3 head sizes x 2 groups; full: every head size, each with a different group, cycling through
    # G = 1, 2, 3 (rounded up to 4), 8 (two chunks of 4) and 12 (three chunks), all dtypes.
    if quick:
        shapes = list(itertools.product([64, 80, 256], [(2, 2), (8, 1)]))
    else:
        groups = [(2, 2), (6, 3), (3, 1), (8, 1), (12, 1)]
        shapes = [(d, groups[i % len(groups)]) for i, d in enumerate([64, 80, 96, 112, 128, 256] * 2)]
    for fmt, dtype in itertools.product(QUANT_FORMATS, dtypes):
        for n, (head_size, (num_heads, num_kv_heads)) in enumerate(shapes):
            block_size = [8, 16, 32][(head_size // 16 + n) % 3]
            for version in (1, 2):
                checker.decode(version, [0, 1, 37, 300], num_heads, num_kv_heads, head_size, block_size, dtype,
                               alibi=num_heads % 3 == 0, strided=head_size == 96, seed=head_size + num_heads,
                               kv_cache_dtype=fmt)
            checker.prefill([37, 70, 1, 0], [0, 45, 100, 9], num_heads, num_kv_heads, head_size, block_size, dtype,
                            seed=head_size + n, kv_cache_dtype=fmt)
        # Window and soft cap (kExtras) and, for fp8, no scale tensors (1.0).
        checker.decode(2, [1, 600, 77], 8, 2, 128, 16, dtype, partition_size=256, window=100, soft_cap=3.0,
                       kv_cache_dtype=fmt, fp8_scales=None, seed=11)
        checker.prefill([40, 3], [30, 90], 6, 2, 128, 16, dtype, window=50, soft_cap=2.0, kv_cache_dtype=fmt,
                        seed=12)
        print(f"  {fmt} {dtype}: ok", flush=True)
    for fmt in QUANT_FORMATS:  # the SIMT (fp32) and tensor-core (bf16) prefill kernels in quick runs too
        checker.prefill([33, 2], [40, 31], 6, 2, 64, 16, torch.float32, seed=13, kv_cache_dtype=fmt)
        checker.prefill([33, 2], [40, 31], 6, 2, 256, 16, torch.bfloat16, seed=14, kv_cache_dtype=fmt)
        checker.decode(1, [5, 77, 300], 10, 2, 96, 8, torch.float32, seed=15, kv_cache_dtype=fmt)
    print("  quantized attention: ok", flush=True)


def run_window(checker: Checker, quick: bool) -> None:
    """Sliding window and soft cap (the kernels' kExtras variants): decode v1/v2 with windows inside a
    block, across blocks and partitions, longer than the sequence; prefill chunks after context."""
    dtypes = [torch.float16] if quick else list(DTYPE_CODE)
    for dtype in dtypes:
        for window, soft_cap in ((1, 0.0), (5, 2.0), (16, 0.0), (37, 0.0), (0, 3.0), (300, 1.5), (1000, 0.0)):
            for version in (1, 2):
                checker.decode(version, [0, 1, 37, 300], 8, 2, 64, 16, dtype, alibi=True, window=window,
                               soft_cap=soft_cap, seed=window)
            checker.prefill([37, 70, 1, 0], [0, 45, 100, 9], 6, 2, 64, 16, dtype, window=window, soft_cap=soft_cap,
                            seed=window)
        checker.decode(2, [1, 1100, 513], 12, 1, 128, 8, dtype, partition_size=256, window=300, soft_cap=4.0, seed=3)
        checker.prefill([150, 2], [5, 60], 8, 2, 256, 32, dtype, window=40, seed=4)
        checker.window_freed_blocks(dtype)
    # seq_lens above max_seq_len (index checks off): the window lies past the launched partitions.
    checker.decode(2, [700, 1300, 90], 4, 2, 64, 16, torch.float16, partition_size=256, max_seq_len=500, window=100,
                   seed=4)
    print("  window / soft cap: ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fp16 and four head sizes only"
    )
    parser.add_argument("--build-dir", default=str(ROOT / "build" / "cuda_emulation"))
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "fp16", "bf16"],
                        help="only these dtypes in the shape sweep (the fixed cases always run)")
    parser.add_argument("--head-sizes", nargs="+", type=int, help="only these head sizes in the shape sweep")
    parser.add_argument("--fused-only", action="store_true", help="only the fused norm / rotary kernels")
    parser.add_argument("--quant-only", action="store_true", help="only the quantized KV cache checks")
    args = parser.parse_args()
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [names[d] for d in args.dtypes] if args.dtypes else None
    lib = build(Path(args.build_dir))
    bind(lib)
    checker = Checker(lib, load_reference())
    if args.quant_only:
        run_quant(checker, args.quick)
    elif not args.fused_only:
        run(checker, args.quick, dtypes, args.head_sizes)
        run_quant(checker, args.quick)
    if not args.quant_only:
        run_fused(checker)
    print(f"cuda emulation: {checker.cases} checks passed")


if __name__ == "__main__":
    sys.exit(main())
