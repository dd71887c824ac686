"""KV memory utilization: static max_model_len reservation vs paged blocks (the real block manager and scheduler).

No model runs: only the memory bookkeeping is replayed, step by step.

Trace (seeded): N requests, all queued at once (an offline batch, so the
system stays saturated and concurrency is limited by memory alone). Prompt
and output lengths are long-tailed, log-normal like chat traces:
    prompt ~ round(LogNormal(ln 200, 1.0)) clipped to [4, 1536]
    output ~ round(LogNormal(ln 150, 0.9)) clipped to [1, max_model_len - prompt]
The same KV budget (default 16 x max_model_len tokens) for every system.

  static     HF-style: each request reserves max_model_len slots when admitted and keeps them until it
             finishes; a freed reservation goes to the next request at once (more generous than static
             batches, which wait for the batch's longest request).
  paged-B    pagedkv.core.Scheduler + the C++ BlockManager at block size B (8, 16, 32): requests are
             admitted, chunk-prefilled, decoded one token a step, preempted (recompute) and finished exactly
             as in the engine, with every model call replaced by "the sampled token is 0".

Per step: tokens held in the KV cache vs slots reserved. Reported, weighted over all steps: the fraction of
reserved slots that hold tokens; the rest split into slots reserved for tokens the request will still
generate, and slots it never uses (static: max_model_len minus its final length; paged: the unused tail of
its last block, i.e. internal fragmentation); mean and max concurrent requests at the budget.
Also the design notes' 3-request example, and a block-table diagram of a few live requests.

Usage: python3 bench/bench_memory.py [--num-requests 1000] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import header_lines, machine_info, markdown_table, write_results
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core import BlockManager
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.sequence import Request, Sequence
from pagedkv.outputs import RequestMetrics
from pagedkv.sampling_params import SamplingParams

BLOCK_SIZES = (8, 16, 32)
TARGET_UTILIZATION = 0.96  # the vLLM paper reports 96.3% for PagedAttention
TARGET_CONCURRENCY = 2.5  # x the static reservation's, at the same budget


# --- trace ---------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class Trace:
    prompt_lens: list[int]
    output_lens: list[int]

    def final_len(self, i: int) -> int:
        return self.prompt_lens[i] + self.output_lens[i]


def make_trace(num_requests: int, seed: int, max_model_len: int) -> Trace:
    """Seeded long-tailed lengths (see the module docstring); every request fits in max_model_len."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        p = min(max(round(rng.lognormvariate(math.log(200), 1.0)), 4), min(1536, max_model_len - 1))
        o = min(max(round(rng.lognormvariate(math.log(150), 0.9)), 1), max_model_len - p)
        prompts.append(p)
        outputs.append(o)
    return Trace(prompts, outputs)


# --- results -------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class MemoryResult:
    """Slot-steps summed over a replay: tokens held, reserved for future tokens, never used."""

    system: str
    token_slot_steps: int = 0  # slots holding a token's KV
    future_slot_steps: int = 0  # reserved for tokens the request will still generate
    unused_slot_steps: int = 0  # reserved and never used (internal fragmentation)
    concurrency: list[int] = field(default_factory=list)  # running requests per step while some wait
    max_concurrency: int = 0
    steps: int = 0
    preemptions: int = 0

    @property
    def reserved(self) -> int:
        return self.token_slot_steps + self.future_slot_steps + self.unused_slot_steps

    def fraction(self, part: int) -> float:
        return part / self.reserved if self.reserved else 0.0

    @property
    def utilization(self) -> float:
        return self.fraction(self.token_slot_steps)

    @property
    def mean_concurrency(self) -> float:
        return sum(self.concurrency) / len(self.concurrency) if self.concurrency else float(self.max_concurrency)

    def summary(self) -> dict:
        return {"system": self.system, "utilization": self.utilization,
                "future_fraction": self.fraction(self.future_slot_steps),
                "unused_fraction": self.fraction(self.unused_slot_steps), "mean_concurrency": self.mean_concurrency,
                "max_concurrency": self.max_concurrency, "steps": self.steps, "preemptions": self.preemptions}


# --- static reservation ----------------------------------------------------------------------------------------

def replay_static(trace: Trace, budget_tokens: int, max_model_len: int) -> MemoryResult:
    """Each request holds max_model_len slots from admission (prompt computed at once) to its last token."""
    slots = budget_tokens // max_model_len
    res = MemoryResult("static")
    queue = list(range(len(trace.prompt_lens)))[::-1]  # pop() from the end = FCFS
    running: dict[int, int] = {}  # request -> tokens held
    while queue or running:
        while queue and len(running) < slots:
            i = queue.pop()
            running[i] = trace.prompt_lens[i]  # the prompt's KV, plus its first sampled token's slot below
        if queue:
            res.concurrency.append(len(running))
        res.max_concurrency = max(res.max_concurrency, len(running))
        for i, held in running.items():
            last = trace.final_len(i) - 1  # KV slots a request ever fills: its last sampled token gets none
            res.token_slot_steps += held
            res.future_slot_steps += last - held
            res.unused_slot_steps += max_model_len - last
        res.steps += 1
        for i in list(running):
            running[i] += 1
            if running[i] > trace.final_len(i) - 1:  # the last output token's KV is never written
                del running[i]
    return res


# --- paged: the engine's scheduler and block manager, no model --------------------------------------------------

def make_sequences(trace: Trace) -> list[Sequence]:
    """One greedy sequence per request, its prompt as token 0s (without prefix caching only lengths matter)."""
    seqs = []
    for i, (p, o) in enumerate(zip(trace.prompt_lens, trace.output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o)
        req = Request(str(i), None, [0] * p, params, RequestMetrics(0.0))
        req.seqs.append(Sequence(i, req, 0, [0] * p))
        seqs.append(req.seqs[0])
    return seqs


def advance(scheduler: Scheduler, out) -> None:
    """The engine's postprocess without a model: computed tokens move on, sampled rows get a token 0."""
    sampled = list(out.decode_seqs) + [s for i, s in enumerate(out.prefill_seqs) if out.sampled(i)]
    for seq in out.decode_seqs:
        seq.num_computed_tokens += 1
    for seq, n in zip(out.prefill_seqs, out.prefill_lens, strict=True):
        seq.num_computed_tokens += n
    for seq in sampled:
        seq.token_ids.append(0)
        if seq.num_output_tokens >= seq.request.params.max_tokens:
            scheduler.finish(seq)


def measure_paged(res: MemoryResult, bm: BlockManager, trace: Trace, scheduler: Scheduler) -> None:
    """Adds this step's slots: tokens held, future tokens inside the blocks held, and the rest (internal waste)."""
    held = reserved = future_in_blocks = 0
    for seq_id in bm.seq_ids():
        n = bm.get_num_tokens(seq_id)
        slots = len(bm.get_block_table(seq_id)) * bm.block_size
        held += n
        reserved += slots
        # Slots in the last block that this request's later tokens will fill count as "future", not waste.
        future_in_blocks += min(slots, trace.final_len(seq_id) - 1) - n
    res.token_slot_steps += held
    res.future_slot_steps += future_in_blocks
    res.unused_slot_steps += reserved - held - future_in_blocks
    running = len(bm.seq_ids())
    if scheduler.waiting:
        res.concurrency.append(running)
    res.max_concurrency = max(res.max_concurrency, running)


def replay_paged(trace: Trace, budget_tokens: int, max_model_len: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> MemoryResult:
    """Runs the trace through Scheduler + BlockManager (C++) with a pool of budget_tokens // block_size blocks."""
    cache = CacheConfig(block_size=block_size)
    bm = BlockManager(block_size, budget_tokens // block_size, 0, cache.watermark, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len), cache, bm)
    for seq in make_sequences(trace):
        sched.add(seq)
    res = MemoryResult(f"paged-{block_size}")
    while sched.num_unfinished:
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the scheduler made no progress: the budget cannot hold one request")
        measure_paged(res, bm, trace, sched)
        advance(sched, out)
        res.steps += 1
    res.preemptions = sched.num_preemptions
    return res


# --- the design notes' example -----------------------------------------------------------------------------------

def three_request_example(block_size: int = 16) -> dict:
    """256, 512 and 128 tokens with 1024 reserved each (static) vs the same tokens in blocks of the real manager."""
    used, reserve = [256, 512, 128], 1024
    bm = BlockManager(block_size, len(used) * reserve // block_size)
    for seq_id, n in enumerate(used):
        bm.allocate(seq_id, n)
    paged_slots = sum(len(bm.get_block_table(s)) for s in range(len(used))) * block_size
    return {"used_tokens": sum(used), "static_reserved": len(used) * reserve, "paged_reserved": paged_slots,
            "static_utilization": sum(used) / (len(used) * reserve), "paged_utilization": sum(used) / paged_slots,
            "paged_free_tokens": bm.num_free_gpu_blocks * block_size, "block_size": block_size}


# --- block-table diagram ------------------------------------------------------------------------------------------

def block_table_scenario(block_size: int = 16, num_blocks: int = 24) -> dict:
    """A few live requests in a small pool of the real manager (prefix caching on), for the diagram.

    A and B share a 2-block system prompt (one physical copy, reference count 2); C is unrelated and grows
    one token at a time beside them, so blocks interleave; D is a second sample of C (fork): it shares C's
    blocks until its first write, which copies the partly filled last block (copy-on-write).
    """
    bm = BlockManager(block_size, num_blocks, enable_caching=True)
    system = list(range(1000, 1000 + 2 * block_size))
    prompts = {"A": system + list(range(1, 11)), "B": system + list(range(50, 70)), "C": list(range(200, 220))}
    ids = {name: i for i, name in enumerate(prompts)}
    for name, prompt in prompts.items():
        bm.allocate(ids[name], prompt)
    for step in range(27):  # decode steps: every request appends a token
        for name in prompts:
            bm.append_slots(ids[name], 1, [3000 + step])
    ids["D"] = 3
    bm.fork(ids["C"], ids["D"])
    cow = bm.append_slots(ids["D"], 1, [4000])
    tables = {name: bm.get_block_table(i) for name, i in ids.items()}
    return {"block_size": block_size, "num_blocks": num_blocks, "tables": tables,
            "num_tokens": {name: bm.get_num_tokens(i) for name, i in ids.items()}, "copy_on_write": cow,
            "free_blocks": bm.num_free_gpu_blocks}


def block_table_text(scn: dict) -> str:
    """The diagram as text: 'A: L0->B0 L1->B1 ...' per request, shared blocks marked with *."""
    counts: dict[int, int] = {}
    for table in scn["tables"].values():
        for b in table:
            counts[b] = counts.get(b, 0) + 1
    lines = [f"{name} ({scn['num_tokens'][name]} tokens): "
             + " ".join(f"L{i}->B{b}{'*' if counts[b] > 1 else ''}" for i, b in enumerate(table))
             for name, table in scn["tables"].items()]
    used = set(counts)
    lines.append(f"free: {scn['num_blocks'] - len(used)} of {scn['num_blocks']} blocks; * = shared "
                 f"(reference count > 1); copy-on-write on D's first token: {scn['copy_on_write']}")
    return "\n".join(lines)


# --- pictures -------------------------------------------------------------------------------------------------------

def plot_utilization(results: list[MemoryResult], path: Path, note: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.system for r in results]
    parts = [("tokens (KV in use)", "token_slot_steps", "#2b8a3e"),
             ("empty, filled later (future tokens)", "future_slot_steps", "#f59f00"),
             ("empty, never filled", "unused_slot_steps", "#c92a2a")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(results)
    for label, attr, color in parts:
        vals = [100 * r.fraction(getattr(r, attr)) for r in results]
        ax1.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for x, r in enumerate(results):
        ax1.text(x, 100 * r.utilization / 2, f"{100 * r.utilization:.1f}%", ha="center", color="white",
                 fontweight="bold")
    ax1.axhline(100 * TARGET_UTILIZATION, ls="--", color="black", lw=1)
    ax1.set_ylabel("% of reserved KV slots (over all steps)")
    ax1.set_title("What reserved KV memory holds")
    ax1.legend(loc="lower right", fontsize=8)
    means = [r.mean_concurrency for r in results]
    ax2.bar(names, means, color=["#868e96"] + ["#1971c2"] * (len(results) - 1))
    for x, r in enumerate(results):
        ax2.text(x, r.mean_concurrency, f"{r.mean_concurrency:.1f}\n(max {r.max_concurrency})", ha="center",
                 va="bottom", fontsize=8)
    ax2.set_ylabel("concurrent requests (mean while saturated)")
    ax2.set_title("Requests running at the same KV budget")
    ax2.set_ylim(0, max(means) * 1.25)
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_block_tables(scn: dict, path: Path) -> None:
    """Logical blocks of each request (left) -> physical blocks of the pool (right); shared and free shown."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    colors = {"A": "#4dabf7", "B": "#69db7c", "C": "#ffa94d", "D": "#da77f2"}
    owners: dict[int, list[str]] = {}
    for name, table in scn["tables"].items():
        for b in table:
            owners.setdefault(b, []).append(name)
    cols = 6
    fig, ax = plt.subplots(figsize=(11, 5.5))
    phys_xy = {}
    for b in range(scn["num_blocks"]):  # the pool: a grid on the right
        x, y = 7 + (b % cols) * 1.1, 4.6 - (b // cols) * 1.1
        phys_xy[b] = (x, y)
        who = owners.get(b, [])
        face = "#e9ecef" if not who else colors[who[0]]
        ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=face, edgecolor="black", lw=2 if len(who) > 1 else 0.8,
                               hatch="//" if len(who) > 1 else None))
        label = f"B{b}" + (f"\nref {len(who)}" if len(who) > 1 else "" if who else "\nfree")
        ax.text(x + 0.5, y + 0.4, label, ha="center", va="center", fontsize=7)
    for row, (name, table) in enumerate(scn["tables"].items()):  # block tables on the left
        y = 4.6 - row * 1.3
        ax.text(-0.2, y + 0.4, f"{name}\n{scn['num_tokens'][name]} tok", ha="right", va="center", fontsize=8)
        for i, b in enumerate(table):
            x = i * 1.1
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=colors[name], edgecolor="black", lw=0.8))
            ax.text(x + 0.5, y + 0.4, f"L{i}", ha="center", va="center", fontsize=7)
            px, py = phys_xy[b]
            ax.add_artist(FancyArrowPatch((x + 1, y + 0.4), (px, py + 0.4), arrowstyle="->", mutation_scale=8,
                                          lw=0.6, color=colors[name], alpha=0.8))
    ax.text(2.5, 5.7, "logical blocks (block tables)", ha="center", fontsize=10)
    ax.text(7 + cols * 0.55, 5.7, "physical blocks (the pool)", ha="center", fontsize=10)
    ax.set_xlim(-1.5, 7 + cols * 1.1 + 0.2)
    ax.set_ylim(4.6 - 4 * 1.1 - 0.3, 6.1)
    ax.axis("off")
    ax.set_title(f"Block tables of live requests (block_size {scn['block_size']}, C++ BlockManager, prefix caching): "
                 "A and B share the system prompt's blocks (hatched, ref 2); D forked from C", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- report ---------------------------------------------------------------------------------------------------------

def results_table(results: list[MemoryResult]) -> str:
    static = results[0]
    rows = [[r.system, f"{100 * r.utilization:.1f}%", f"{100 * (1 - r.utilization):.1f}%",
             f"{100 * r.fraction(r.future_slot_steps):.1f}%", f"{100 * r.fraction(r.unused_slot_steps):.1f}%",
             f"{r.mean_concurrency:.1f}", r.max_concurrency, f"{r.mean_concurrency / static.mean_concurrency:.2f}x",
             r.steps, r.preemptions] for r in results]
    return markdown_table(["system", "reserved slots holding tokens", "internal fragmentation (empty reserved)",
                           "of which: filled later", "of which: never filled", "mean concurrent",
                           "max concurrent", "vs static", "steps", "preemptions"], rows)


def verdict(results: list[MemoryResult]) -> list[str]:
    static = results[0]
    lines = []
    for r in results[1:]:
        ok_u = r.utilization >= TARGET_UTILIZATION
        ratio = r.mean_concurrency / static.mean_concurrency
        ok_c = ratio >= TARGET_CONCURRENCY
        lines.append(f"- {r.system}: {100 * r.utilization:.1f}% of reserved slots hold tokens (target >= "
                     f"{100 * TARGET_UTILIZATION:.0f}%: {'met' if ok_u else 'MISSED'}); {ratio:.2f}x static's "
                     f"concurrency (target >= {TARGET_CONCURRENCY}x: {'met' if ok_c else 'MISSED'})")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--budget-seqs", type=int, default=16, help="KV budget in max_model_len sequences (static's slots)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--out-dir", default="bench/results", help="where memory_cpu.{md,json} and the PNGs go")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    budget = args.budget_seqs * args.max_model_len
    trace = make_trace(args.num_requests, args.seed, args.max_model_len)
    results = [replay_static(trace, budget, args.max_model_len)]
    for bs in BLOCK_SIZES:
        results.append(replay_paged(trace, budget, args.max_model_len, bs, args.max_num_seqs,
                                    args.max_num_batched_tokens))
    ex = three_request_example()
    scn = block_table_scenario()
    n = len(trace.prompt_lens)
    trace_line = (f"{n} requests (seed {args.seed}), prompt mean {sum(trace.prompt_lens) / n:.0f} / max "
                  f"{max(trace.prompt_lens)} tokens, output mean {sum(trace.output_lens) / n:.0f} / max "
                  f"{max(trace.output_lens)}; KV budget {budget} tokens (= {args.budget_seqs} x max_model_len "
                  f"{args.max_model_len}); max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
                  f"{args.max_num_batched_tokens}")
    example = (f"3-request example: {ex['used_tokens']} of {ex['static_reserved']} reserved slots hold tokens with "
               f"static reservation ({100 * ex['static_utilization']:.1f}%); paged (block {ex['block_size']}): "
               f"{ex['used_tokens']} of {ex['paged_reserved']} ({100 * ex['paged_utilization']:.1f}%), leaving "
               f"{ex['paged_free_tokens']} token slots free for other requests")
    table = results_table(results)
    print(f"trace: {trace_line}\n\n{table}\n\n{example}\n\n" + "\n".join(verdict(results))
          + f"\n\n{block_table_text(scn)}")
    out = Path(args.out_dir)
    info = machine_info()
    md = header_lines("KV memory utilization: static reservation vs paged blocks (bench/bench_memory.py)", info)
    md += [f"- trace: {trace_line}", "", table, "", *verdict(results), "", example, "",
           "Block tables of a few live requests (real C++ BlockManager, prefix caching on):", "", "```",
           block_table_text(scn), "```", ""]
    write_results(out / "memory_cpu", "\n".join(md),
                  {"machine": info, "trace": trace_line, "results": [r.summary() for r in results],
                   "three_request_example": ex, "block_tables": scn, "args": vars(args)})
    if not args.no_plots:
        plot_utilization(results, out / "memory_utilization.png", trace_line)
        plot_block_tables(scn, out / "memory_block_tables.png")
    print(f"\nwrote {out / 'memory_cpu.md'}, .json" + ("" if args.no_plots else ", memory_*.png"), file=sys.stderr)


if __name__ == "__main__":
    main()
