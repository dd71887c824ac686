"""The sampler's cost per step: greedy, temperature, top-p, top-k, against the exponential-race draw it replaced.

    python3 bench/bench_sampler.py [--rows 48] [--vocab 49152] [--reps 30] [--out PATH] [--json PATH]

Rows are a decode batch's sampled rows, the vocabulary the default model's. "race" is the draw pagedkv used
before (argmax of p / E with E ~ Exp(1): one random number per vocabulary entry); "pagedkv" is
`pagedkv.model.sampler.Sampler` (one uniform per row, inverted through the cumulative weights). Both sample
the same distribution (tests/test_sampler.py checks pagedkv's with a chi-square test). Medians of --reps
calls, interleaved, in one process; the ratio is what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_common import machine_info, markdown_table
from pagedkv.model.sampler import Sampler, SamplingBatch, filter_logits

CASES = {"greedy": {"temperature": 0.0}, "temperature 0.8": {"temperature": 0.8},
         "top_p 0.9": {"temperature": 0.8, "top_p": 0.9}, "top_k 50": {"temperature": 0.8, "top_k": 50}}


def make_batch(rows: int, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingBatch:
    f32 = {"dtype": torch.float32}
    return SamplingBatch(temperature == 0.0, torch.full((rows,), temperature, **f32), torch.full((rows,), top_p, **f32),
                         torch.full((rows,), top_k, dtype=torch.int64), torch.zeros(rows, **f32), [None] * rows,
                         [None] * rows, [None] * rows)


def race_draw(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """The replaced draw: temperature, filters, then argmax(p / E) with E ~ Exp(1) drawn for every entry."""
    if batch.all_greedy:
        return logits.argmax(-1)
    scaled = logits / batch.temperatures.unsqueeze(1)
    use = batch.needs_filters
    if any(use):
        scaled = filter_logits(scaled, batch.top_ks, batch.top_ps, batch.min_ps, *use)
    probs = scaled.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3
    sampler, gen = Sampler(torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1)
    rows = []
    for name, params in CASES.items():
        batch = make_batch(args.rows, **params)
        ours, race = [], []
        for _ in range(3):  # warm-up
            sampler(logits, batch)
            race_draw(logits, batch, gen)
        for _ in range(args.reps):  # interleaved, so drift hits both alike
            ours.append(median_ms(lambda b=batch: sampler(logits, b), 1))
            race.append(median_ms(lambda b=batch: race_draw(logits, b, gen), 1))
        o, r = statistics.median(ours), statistics.median(race)
        rows.append({"case": name, "pagedkv_ms": round(o, 3), "race_ms": round(r, 3), "race/pagedkv": round(r / o, 2)})
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
    table = markdown_table(["case", "pagedkv ms", "race ms", "race / pagedkv"],
                           [[r["case"], r["pagedkv_ms"], r["race_ms"], r["race/pagedkv"]] for r in rows])
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
