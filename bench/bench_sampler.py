"""The sampler's cost per step: greedy, temperature, top-p, top-k, against the sampler it replaced.

    python3 bench/bench_sampler.py [--rows 48] [--vocab 49152] [--reps 30] [--out PATH] [--json PATH]

Rows are a decode batch's sampled rows, the vocabulary the default model's. "before" is what pagedkv did
until now: top-k / top-p over a full sort of the vocabulary, then the exponential race (argmax of p / E with
E ~ Exp(1): one random number per vocabulary entry). "pagedkv" is `pagedkv.model.sampler.Sampler`: top-k /
top-p among the 1024 most likely tokens (`torch.topk`, a full sort only for a wider nucleus), one uniform
per row inverted through the cumulative weights; with temperature alone, the fused `ops.sample_from_logits`
(two passes over the logits), timed beside the torch sequence it replaced ("torch sequence": divide, softmax,
cumsum, searchsorted). "x greedy" is each case's time over the greedy case's. Both sample the same
distribution (tests/test_sampler.py checks pagedkv's against a reference filter and with a chi-square test).
Medians of --reps calls, interleaved, in one process; the ratio is what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_common import machine_info, markdown_table
from pagedkv.model.sampler import Sampler, SamplingBatch, draw_from_cdf, filter_logits

# name: (logit scale, sampling params). Logits are N(0, 1) x scale: at scale 3 a top-p 0.9 nucleus fits the
# 1024 candidates; at scale 1 (flat) it does not, and pagedkv falls back to the full sort (its worst case).
CASES = {"greedy": (3.0, {"temperature": 0.0}), "temperature 0.8": (3.0, {"temperature": 0.8}),
         "top_p 0.9": (3.0, {"temperature": 0.8, "top_p": 0.9}), "top_k 50": (3.0, {"temperature": 0.8, "top_k": 50}),
         "top_p 0.9, flat logits": (1.0, {"temperature": 0.8, "top_p": 0.9})}


def make_batch(rows: int, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingBatch:
    f32 = {"dtype": torch.float32}
    return SamplingBatch(temperature == 0.0, torch.full((rows,), temperature, **f32), torch.full((rows,), top_p, **f32),
                         torch.full((rows,), top_k, dtype=torch.int64), torch.zeros(rows, **f32), [None] * rows,
                         [None] * rows, [None] * rows)


def before_sampler(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """The replaced sampler: temperature, filters over a full sort, then argmax(p / E), E ~ Exp(1) per entry."""
    if batch.all_greedy:
        return logits.argmax(-1)
    scaled = logits / batch.temperatures.unsqueeze(1)
    use = batch.needs_filters
    if any(use):
        scaled = filter_logits(scaled, batch.top_ks, batch.top_ps, batch.min_ps, *use, candidates=scaled.shape[-1])
    probs = scaled.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def unfused_sampler(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """The torch sequence `ops.sample_from_logits` replaced for temperature-only batches: divide by the
    temperature, softmax, cumulative sum, then one uniform per row inverted (draw_from_cdf)."""
    cdf = (logits / batch.temperatures.unsqueeze(1)).softmax(-1).cumsum_(-1)
    return draw_from_cdf(cdf, torch.rand(cdf.shape[0], 1, generator=generator))


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    noise = torch.randn(args.rows, args.vocab)
    sampler, gen = Sampler(torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1)
    rows = []
    for name, (scale, params) in CASES.items():
        batch, logits = make_batch(args.rows, **params), noise * scale
        # Temperature only: the fused op, with the torch sequence it replaced beside it.
        fused = not batch.all_greedy and not any(batch.needs_filters)
        ours, before, unfused = [], [], []
        for _ in range(3):  # warm-up
            sampler(logits, batch)
            before_sampler(logits, batch, gen)
        for _ in range(args.reps):  # interleaved, so drift hits both alike
            ours.append(median_ms(lambda b=batch, x=logits: sampler(x, b), 1))
            before.append(median_ms(lambda b=batch, x=logits: before_sampler(x, b, gen), 1))
            if fused:
                unfused.append(median_ms(lambda b=batch, x=logits: unfused_sampler(x, b, gen), 1))
        o, r = statistics.median(ours), statistics.median(before)
        rows.append({"case": name, "pagedkv_ms": round(o, 3), "before_ms": round(r, 3),
                     "before/pagedkv": round(r / o, 2),
                     "unfused_ms": round(statistics.median(unfused), 3) if fused else None})
    greedy_ms = rows[0]["pagedkv_ms"]
    for r in rows:
        r["x_greedy"] = round(r["pagedkv_ms"] / greedy_ms, 2)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    info = machine_info()
    rows = run(args)
    table = markdown_table(["case", "pagedkv ms", "x greedy", "torch sequence ms", "before ms", "before / pagedkv"],
                           [[r["case"], r["pagedkv_ms"], r["x_greedy"],
                             "—" if r["unfused_ms"] is None else r["unfused_ms"], r["before_ms"], r["before/pagedkv"]]
                            for r in rows])
    text = "\n".join(["# Sampler: one step's draw", "", *(f"- {k}: {v}" for k, v in info.items()),
                      f"- rows {args.rows}, vocabulary {args.vocab}, medians of {args.reps} interleaved calls", "",
                      table, ""])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows, "settings": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
