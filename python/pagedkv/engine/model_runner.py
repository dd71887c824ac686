"""Runs one scheduled step on the model: block copies, inputs, forward, logits, sampling.

The batch is flat (no padding): decode tokens first, then prefill chunks.
Its metadata (block tables, slot mapping, sequence lengths) is written by
the C++ block manager straight into preallocated CPU buffers, one call per
step; on CUDA it then goes to the device in one copy each. Logits are
computed only for the rows whose next token is sampled.

Sliding-window models: the block tables carry DROPPED_BLOCK (-1) where the
block manager released a block before the window; the attention ops, given
the layer's window, neither read nor index-check an entry wholly before it.

Quantized caches (`kv_cache_dtype`, pagedkv.kv_cache): each layer's KVCache
carries its format and scales, and every op gets them. A block is its value
rows plus, for the per-token-head formats, its scale-plane rows: swapping
and copy-on-write move both. fp8's per-layer scales are not block data;
they come from the checkpoint, or from the first step with prefill tokens
(`calculate_kv_scales`), or are 1.0 (pagedkv.model.kv_scales).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv import host_memory, ops
from pagedkv.bad_words import banned_next_tokens
from pagedkv.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.kv_tiers import TierMoves
from pagedkv.core.scheduler import SchedulerOutput
from pagedkv.core.sequence import Sequence
from pagedkv.core.step_batch import BlockOps, StepBatch
from pagedkv.distributed.step_channel import StepChannel
from pagedkv.engine.cuda_graphs import DecodeGraphs
from pagedkv.engine.pool_rows import PoolRows
from pagedkv.engine.prompt_logprobs import PromptLogits, PromptRows
from pagedkv.engine.prompt_logprobs import plan_rows as plan_prompt_rows
from pagedkv.kv_cache import KVCache, allocate_layer_cache, gather_block_bytes, kv_cache_format, scatter_block_bytes
from pagedkv.lora.manager import LoRAManager
from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from pagedkv.model.protocol import CausalLM
from pagedkv.model.sampler import Sampler, SamplingBatch
from pagedkv.outputs import SamplerOutput
from pagedkv.supported import kv_cache_format_refusal

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    """A step's flat batch on the model's device."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: rows of the batch whose next token is sampled


def allocate_kv_cache(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, pin: bool = False, kv_cache_dtype: str = "auto") -> list[KVCache]:
    """Per layer a KVCache: key/value [num_blocks, block_size, num_kv_heads, X] in `kv_cache_dtype`'s format
    (X = head_dim, or head_dim / 2 for int4), with its scale planes or per-layer fp8 scales (dtype: the compute
    dtype, what "auto" stores).

    CPU memory is left untouched here (the kernels never read a slot before it
    is written; ModelRunner backs the pages from an idle thread) and is backed by transparent huge pages
    where the host allows (pagedkv.host_memory: fewer TLB misses in decode);
    the scale planes too, as they are read beside the values. CUDA caches are
    zeroed; `pin`: page-locked CPU memory (a CUDA engine's swap cache).
    """
    fmt = kv_cache_format(kv_cache_dtype)

    def make(shape: tuple[int, ...], element: torch.dtype) -> torch.Tensor:
        if device.type == "cpu" and not pin:
            return host_memory.empty_huge_pages(shape, element)
        if device.type == "cuda":
            return torch.zeros(shape, dtype=element, device=device)
        return torch.empty(shape, dtype=element, device=device, pin_memory=pin)

    return [allocate_layer_cache(fmt, num_blocks, block_size, num_kv_heads, cfg.head_dim, dtype, make)
            for _ in range(cfg.num_hidden_layers)]


def check_kv_cache_dtype(kv_cache_dtype: str, head_size: int, block_size: int) -> None:
    """Refuses at start a cache dtype this model cannot store, naming the setting.

    The format's head and block size rule is `pagedkv.supported.kv_cache_format_refusal` (every CPU
    kernel variant, "default" included, reads and writes every format).
    """
    fmt = kv_cache_format(kv_cache_dtype)
    problem = kv_cache_format_refusal(fmt, head_size, block_size)
    if problem:
        raise ValueError(f"{problem}; use kv_cache_dtype='auto'")


def fp8_scale_source(calculate: bool | None, found: list[tuple[float | None, float | None]]) -> str:
    """Where an fp8 cache's scales come from: "calculate" (the first batch), "checkpoint" or "one" (1.0).

    found: per layer the checkpoint's (k_scale, v_scale), None where it has none. vLLM's rule, with None
    computing only what the checkpoint does not give: True always computes, False never does.
    """
    has_any = any(s is not None for pair in found for s in pair)
    if calculate or (calculate is None and not has_any):
        return "calculate"
    return "checkpoint" if has_any else "one"


def _scale_range(values: list[float]) -> str:
    return f"{min(values):.4g}" if min(values) == max(values) else f"{min(values):.4g}-{max(values):.4g}"


class ModelRunner:
    """Owns the model, its paged KV cache (and CPU swap cache), and the per-step input buffers."""

    def __init__(self, model: CausalLM, block_manager: BlockManager | None, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, channel: StepChannel | None = None,
                 cuda_graphs: bool = False) -> None:
        """block_manager: the driver's (None on a tensor-parallel worker, which gets its batches built).

        channel: where a tensor-parallel driver sends each step to its workers.
        cuda_graphs: on CUDA, capture decode steps now and replay them (pagedkv.engine.cuda_graphs).
        """
        self.model, self.bm, self.dtype, self.device, self.channel = model, block_manager, dtype, device, channel
        cfg = model.config
        self.block_size = cache_config.block_size
        self.kv_format = kv_cache_format(cache_config.cache_dtype)
        # The swap cache has the same format, so a block swaps as bytes, scale-plane rows included.
        self.kv_caches = allocate_kv_cache(cfg, model.num_kv_heads, num_gpu_blocks, self.block_size, dtype, device,
                                           kv_cache_dtype=self.kv_format.name)
        # Pages backed ahead of the blocks' first writes, from an idle-priority thread (host_memory).
        self.idle_clock = host_memory.IdleClock()
        self.kv_prefault = (host_memory.BackgroundPrefault([t for kv in self.kv_caches for t in kv.block_tensors()],
                                                           idle=self.idle_clock)
                            if device.type == "cpu" and host_memory.prefault_enabled() else None)
        self.cpu_caches = self._host_cache(num_cpu_blocks) if num_cpu_blocks else []
        self.host_caches: list[KVCache] = []  # the prefix cache's host tier (allocate_host_tier)
        self.kv_scales_pending = self._init_kv_scales(cache_config.calculate_kv_scales)
        self.max_blocks_per_seq = -(-scheduler_config.max_model_len // self.block_size)
        self.sliding_window = cfg.kv_sliding_window or 0  # entries before it are dropped blocks
        max_seqs, max_tokens = scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens
        self._block_tables = np.zeros(max_seqs * self.max_blocks_per_seq, dtype=np.int32)
        self._slot_mapping = np.zeros(max_tokens, dtype=np.int64)
        self._seq_lens = np.zeros(max_seqs, dtype=np.int32)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids: set[int] = set()  # set by the engine; banned before a request's min_tokens
        self.sampler = Sampler(self.generator)
        self.lora: LoRAManager | None = None  # the adapters' slots when the engine serves LoRA (device_setup)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self._forward_logits, device, max_seqs, self.max_blocks_per_seq,
                                       scheduler_config.max_model_len)
            self.graphs.capture()

    # --- fp8 scales ------------------------------------------------------------
    def _init_kv_scales(self, calculate: bool | None) -> bool:
        """Puts the checkpoint's fp8 scales (else 1.0) into each layer's KVCache; returns whether the first step
        with prefill tokens is to compute them (`fp8_scale_source`)."""
        if not self.kv_format.is_fp8:
            if calculate and self.kv_format.quantized:
                logger.info("calculate_kv_scales: %s has no per-tensor scales (each token's are written with it)",
                            self.kv_format.name)
            return False
        found = self.model.checkpoint_kv_scales()
        source = fp8_scale_source(calculate, found)
        name = self.kv_format.name
        if source == "calculate":
            logger.info("fp8 KV-cache scales (%s): computed from the first batch with prefill tokens, per layer "
                        "(amax / %g for K, / %g for V)%s", name, K_SCALE_CONSTANT, V_SCALE_CONSTANT,
                        "; the checkpoint's are not used (calculate_kv_scales=True)"
                        if any(s is not None for pair in found for s in pair) else "")
            return True
        for kv, (k, v) in zip(self.kv_caches, found, strict=True):
            kv.k_scale.fill_(1.0 if k is None else k)
            kv.v_scale.fill_(1.0 if v is None else v)
        if source == "one":
            logger.info("fp8 KV-cache scales (%s): 1.0 (calculate_kv_scales=False and the checkpoint has none)", name)
            return False
        missing = sum(s is None for pair in found for s in pair)
        ks, vs = [k for k, _ in found if k is not None], [v for _, v in found if v is not None]
        logger.info("fp8 KV-cache scales (%s): from the checkpoint, k_scale %s, v_scale %s%s", name,
                    _scale_range(ks) if ks else "none", _scale_range(vs) if vs else "none",
                    f" ({missing} of {2 * len(found)} missing: 1.0)" if missing else "")
        return False

    def kv_scales(self) -> list[tuple[float, float]]:
        """Per layer the fp8 cache's (k_scale, v_scale) now (a device sync; for logs and tests)."""
        return [(kv.k_scale.item(), kv.v_scale.item()) for kv in self.kv_caches]

    def _log_calibrated_scales(self) -> None:
        scales = self.kv_scales()
        logger.info("fp8 KV-cache scales (%s) computed from the first batch: k_scale %s, v_scale %s",
                    self.kv_format.name, _scale_range([k for k, _ in scales]), _scale_range([v for _, v in scales]))

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor | None:
        """The forward a decode graph captures: logits of every row (a graph's batch is all decodes)."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    # --- block copies --------------------------------------------------------
    def allocate_host_tier(self, num_slots: int) -> None:
        """The prefix cache's host tier: `num_slots` blocks in host memory, in the cache's format (pinned on CUDA,
        so the copies can run asynchronously)."""
        self.host_caches = self._host_cache(num_slots)

    def _host_cache(self, num_blocks: int) -> list[KVCache]:
        """Blocks in host memory in the device cache's format (pinned on CUDA), so a block moves as bytes: the
        swap space and the host tier."""
        return allocate_kv_cache(self.model.config, self.model.num_kv_heads, num_blocks, self.block_size, self.dtype,
                                 torch.device("cpu"), pin=self.device.type == "cuda",
                                 kv_cache_dtype=self.kv_format.name)

    @staticmethod
    def _swap(src: list[KVCache], dst: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        """swap_blocks of (src block, dst block) pairs for every layer: values, then the per-token scale planes
        (every tensor a block id indexes)."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for s_kv, d_kv in zip(src, dst, strict=True):
            for s_t, d_t in zip(s_kv.block_tensors(), d_kv.block_tensors(), strict=True):
                ops.swap_blocks(s_t, d_t, mapping)

    def apply_block_ops(self, block_ops: BlockOps) -> None:
        """The step's block moves, each before anything writes over what it reads: offload to the host tier
        (this step's newly allocated blocks held evicted prefixes), swap out, restores from the tiers, swap in,
        then copy-on-write."""
        tiers: TierMoves | None = block_ops.tiers
        if tiers is not None:
            self._swap(self.kv_caches, self.host_caches, tiers.offload)
        self._swap(self.kv_caches, self.cpu_caches, block_ops.swap_out)
        if tiers is not None:
            self._swap(self.host_caches, self.kv_caches, tiers.restore_host)
            if tiers.restore_disk is not None:
                scatter_block_bytes(self.kv_caches, tiers.restore_disk.blocks, tiers.restore_disk.payload)
        self._swap(self.cpu_caches, self.kv_caches, block_ops.swap_in)
        if block_ops.copy:
            mapping = torch.tensor(block_ops.copy, dtype=torch.int64, device=self.device)
            planes = ({"key_scales": [kv.k_scale for kv in self.kv_caches],
                       "value_scales": [kv.v_scale for kv in self.kv_caches]}
                      if self.kv_format.per_token_scale else {})
            ops.copy_blocks([kv.key for kv in self.kv_caches], [kv.value for kv in self.kv_caches], mapping,
                            **planes)

    def block_bytes(self, blocks: list[int]) -> np.ndarray:
        """The bytes of device `blocks` (uint8 [n, block bytes], pagedkv.kv_cache.gather_block_bytes)."""
        return gather_block_bytes(self.kv_caches, blocks)

    # --- inputs --------------------------------------------------------------
    def build_batch(self, out: SchedulerOutput) -> tuple[StepBatch, list[Sequence], list[PromptRows], PoolRows]:
        """The step's flat batch on the host, the sequences of its sampled rows, the chunks' rows that score
        prompt tokens, and the pooling requests' chunks (driver only).

        logits_indices holds the sampled rows, then the prompt-scoring rows (pagedkv.engine.prompt_logprobs).
        A speculating decode (out.spec_seqs) runs as a chunk after the prefill chunks: its last token, then its
        drafts, every row sampled (its sequence once per row). A pooling request's chunk samples nothing: its
        rows are pooled (pagedkv.engine.pool_rows).
        """
        decodes, prefills, lens = out.decode_seqs, out.prefill_seqs, out.prefill_lens
        spec = out.spec_seqs
        if spec:
            prefills, lens = [*prefills, *spec], [*lens, *(1 + len(s.spec_token_ids) for s in spec)]
        nd, npf = len(decodes), len(prefills)
        ids: list[int] = [s.token_ids[-1] for s in decodes]
        pos: list[int] = [s.num_computed_tokens for s in decodes]
        sampled_seqs: list[Sequence] = list(decodes)
        logits_rows: list[int] = list(range(nd))
        prompt_rows: list[PromptRows] = []
        pool = PoolRows()
        scored_rows: list[int] = []
        row = nd
        for s, n in zip(prefills, lens, strict=True):
            start = s.num_computed_tokens
            if s.spec_token_ids:
                ids.append(s.token_ids[-1])
                ids.extend(s.spec_token_ids)
                pos.extend(range(start, start + n))
                sampled_seqs.extend([s] * n)
                logits_rows.extend(range(row, row + n))
                row += n
                continue
            ids.extend(s.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            if s.request.pooling is not None:
                pool.add_chunk(s, start, n, row)
                row += n
                continue
            scoring = plan_prompt_rows(s, start, n)
            if scoring is not None:
                prompt_rows.append(scoring)
                first = row + scoring.offset
                scored_rows.extend(range(first, first + len(scoring.targets)))
            row += n
            if start + n == len(s.token_ids):
                sampled_seqs.append(s)
                logits_rows.append(row - 1)
        logits_rows.extend(scored_rows)
        seq_lens_py = [s.num_computed_tokens + 1 for s in decodes] + [
            s.num_computed_tokens + n for s, n in zip(prefills, lens, strict=True)]
        num_seqs = nd + npf
        width = -(-max(seq_lens_py) // self.block_size)
        block_tables = self._block_tables[:num_seqs * width].reshape(num_seqs, width)
        seq_ids = np.fromiter((s.seq_id for s in decodes), np.int64, nd)
        if npf:
            seq_ids = np.concatenate([seq_ids, np.fromiter((s.seq_id for s in prefills), np.int64, npf)])
        query_lens = np.concatenate([np.ones(nd, np.int64), np.asarray(lens, np.int64)]) if npf else None
        num_tokens = self.bm.fill_metadata(seq_ids, block_tables, self._slot_mapping, self._seq_lens, query_lens)
        qsl = np.zeros(npf + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        lora = self._lora_map(decodes, prefills, lens) if self.lora is not None else None
        batch = StepBatch(
            input_ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(pos, dtype=np.int64),
            slot_mapping=self._slot_mapping[:num_tokens], block_tables=block_tables,
            seq_lens=self._seq_lens[:num_seqs], query_start_loc=qsl,
            logits_indices=np.asarray(logits_rows, dtype=np.int64), num_decode_tokens=nd,
            decode_max_seq_len=max(seq_lens_py[:nd], default=0), prefill_max_query_len=max(lens, default=0),
            prefill_max_seq_len=max(seq_lens_py[nd:], default=0),
            lora_rows=lora[0] if lora else None, lora_starts=lora[1] if lora else None)
        return batch, sampled_seqs, prompt_rows, pool

    def _lora_map(self, decodes: list[Sequence], prefills: list[Sequence],
                  lens: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's rows per adapter slot (loading the adapters it needs into slots; pagedkv.lora.manager)."""
        requests = [s.request.lora_request for s in decodes] + [s.request.lora_request for s in prefills]
        return self.lora.step_map(requests, [1] * len(decodes) + list(lens))

    def device_inputs(self, batch: StepBatch) -> StepInputs:
        """The batch's arrays on the model's device (zero-copy on the CPU, one copy each on CUDA)."""
        dev = self.device
        to_dev = (lambda a: torch.from_numpy(a)) if dev.type == "cpu" else (
            lambda a: torch.from_numpy(a).to(dev, non_blocking=True))
        nd = batch.num_decode_tokens
        bt, sl = to_dev(batch.block_tables), to_dev(batch.seq_lens)
        meta = AttentionMetadata(
            num_decode_tokens=nd,
            slot_mapping=to_dev(batch.slot_mapping),
            decode_block_tables=bt[:nd], decode_seq_lens=sl[:nd],
            decode_max_seq_len=batch.decode_max_seq_len,
            num_prefills=batch.num_prefills,
            prefill_block_tables=bt[nd:], prefill_seq_lens=sl[nd:],
            prefill_query_start_loc=to_dev(batch.query_start_loc),
            prefill_max_query_len=batch.prefill_max_query_len,
            prefill_max_seq_len=batch.prefill_max_seq_len,
        )
        return StepInputs(to_dev(batch.input_ids), to_dev(batch.positions), meta, to_dev(batch.logits_indices))

    def sampling_batch(self, rows: list[Sequence]) -> SamplingBatch:
        params = [s.request.params for s in rows]
        all_greedy = all(p.temperature == 0.0 for p in params)
        simple = all_greedy and all(not p.shapes_logits and p.logprobs is None and p.min_tokens == 0
                                    and s.grammar is None for p, s in zip(params, rows, strict=True))
        n = len(rows)
        if simple:  # the common greedy case: no per-row tensors to build
            empty = torch.empty(0)
            return SamplingBatch(True, empty, empty, empty, empty, [None] * n, [None] * n, [None] * n)
        f32 = {"dtype": torch.float32, "device": self.device}
        return SamplingBatch(
            all_greedy=all_greedy,
            temperatures=torch.tensor([p.temperature for p in params], **f32),
            top_ps=torch.tensor([p.top_p for p in params], **f32),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=self.device),
            min_ps=torch.tensor([p.min_p for p in params], **f32),
            generators=[s.generator for s in rows],
            penalties=[(p.repetition_penalty, s.token_ids) if p.repetition_penalty != 1.0 else None
                       for p, s in zip(params, rows, strict=True)],
            num_logprobs=[p.logprobs for p in params],
            banned=[self._banned(p, s) for p, s in zip(params, rows, strict=True)],
            allowed=[self._allowed(p, s) for p, s in zip(params, rows, strict=True)],
            biases=[self._biases(p, s) for p, s in zip(params, rows, strict=True)],
            output_penalties=[(p.presence_penalty, p.frequency_penalty, s.output_token_ids)
                              if p.presence_penalty or p.frequency_penalty else None
                              for p, s in zip(params, rows, strict=True)],
            grammars=[s.grammar for s in rows],
        )

    def _allowed(self, p, seq: Sequence) -> torch.Tensor | None:
        """allowed_token_ids as a tensor, built once per request."""
        if p.allowed_token_ids is None:
            return None
        req = seq.request
        if req.allowed_ids_tensor is None:
            req.allowed_ids_tensor = torch.tensor(sorted(set(p.allowed_token_ids)), dtype=torch.long,
                                                  device=self.device)
        return req.allowed_ids_tensor

    def _biases(self, p, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logit_bias as (ids, values) tensors, built once per request."""
        if p.logit_bias is None:
            return None
        req = seq.request
        if req.logit_bias_tensors is None:
            ids, values = zip(*sorted(p.logit_bias.items()), strict=True)
            req.logit_bias_tensors = (torch.tensor(ids, dtype=torch.long, device=self.device),
                                      torch.tensor(values, dtype=torch.float32, device=self.device))
        return req.logit_bias_tensors

    def _banned(self, p, seq: Sequence) -> list[int] | None:
        """The tokens this row may not sample now: those that would complete a bad word (pagedkv.bad_words), and
        before min_tokens those that would end the sequence (as in vLLM)."""
        words = seq.request.bad_words_ids
        completing = banned_next_tokens(words, seq.token_ids, seq.num_prompt_tokens) if words else None
        before_min = self._banned_before_min_tokens(p, seq)
        if completing and before_min:
            return before_min + completing
        return completing or before_min

    def _banned_before_min_tokens(self, p, seq: Sequence) -> list[int] | None:
        """EOS and the stop ids until min_tokens; built once per request (the same every step until then)."""
        if seq.num_output_tokens >= p.min_tokens:
            return None
        req = seq.request
        if req.banned_before_min_tokens is None:
            eos = frozenset() if p.ignore_eos else self.eos_token_ids
            req.banned_before_min_tokens = sorted(p.all_stop_token_ids | eos)
        return req.banned_before_min_tokens

    # --- one step --------------------------------------------------------------
    def check_batch(self, batch: StepBatch) -> None:
        """The kernels' index checks, once per step on the host arrays.

        The forward then runs with the ops' own checks off: on CUDA they would
        copy the metadata back and sync in every layer (and forbid graph
        capture); on the CPU they would scan it again in every layer. With an
        all-sliding model the entries before the window are not checked (the
        block manager drops those blocks; no layer reads them).
        """
        nd, num_blocks = batch.num_decode_tokens, self.kv_caches[0][0].shape[0]
        window = self.sliding_window
        ops.validate_decode_metadata(batch.block_tables[:nd], batch.seq_lens[:nd], num_blocks=num_blocks,
                                     block_size=self.block_size, max_seq_len=batch.decode_max_seq_len,
                                     slot_mapping=batch.slot_mapping, sliding_window=window)
        if batch.num_prefills:
            ops.validate_prefill_metadata(batch.block_tables[nd:], batch.seq_lens[nd:], batch.query_start_loc,
                                          num_blocks=num_blocks, block_size=self.block_size,
                                          num_tokens=batch.num_tokens - nd,
                                          max_query_len=batch.prefill_max_query_len,
                                          max_seq_len=batch.prefill_max_seq_len, sliding_window=window)

    @torch.inference_mode()
    def run_batch(self, block_ops: BlockOps, batch: StepBatch, checked: bool = False,
                  pool: PoolRows | None = None) -> torch.Tensor | None:
        """Block copies, forward, logits of the sampled rows: float32 [L, vocab] (None on tensor-parallel workers).

        checked: `check_batch` has passed already (the driver checks before it sends a step to the workers).
        A batch that fails the check raises before any block moves. pool: the pooling requests' rows, which get
        their final hidden states (the driver's; every rank holds the whole hidden state).
        """
        if not checked:
            self.check_batch(batch)
        with self.idle_clock.busy():
            return self._forward(block_ops, batch, pool)

    def _forward(self, block_ops: BlockOps, batch: StepBatch, pool: PoolRows | None = None) -> torch.Tensor | None:
        self.apply_block_ops(block_ops)
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        inputs = self.device_inputs(batch)
        # Every rank decides alike (same batch, same state), and each computes the scales of its own heads.
        calibrate = self.kv_scales_pending and batch.num_prefills > 0
        inputs.meta.calibrate_kv_scales = calibrate
        if self.lora is not None:
            self.lora.set_step(batch.lora_rows, batch.lora_starts)
        try:
            with ops.index_checks(False):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        finally:
            if self.lora is not None:  # another engine sharing the model must not see this step's map
                self.lora.set_step(None, None)
        if calibrate:  # only once the forward went through: a failed step leaves it to the next one
            self.kv_scales_pending = False
            self._log_calibrated_scales()
        if pool:
            pool.take(self.model.final_hidden(hidden.index_select(0, pool.indices(hidden.device))))
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor, PromptLogits | None]:
        """Runs the step's forward; returns the sequences whose next token is due, their float32 logits
        [len(rows), vocab] (a prompt forking n > 1 samples has one row per sample), and the logits of the rows
        that score prompt tokens (None when no request in the step asks for prompt logprobs). Pooling requests'
        chunks hand their hidden states to their requests' PoolingState (pagedkv.pooler)."""
        block_ops = BlockOps(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy,
                             out.tier_moves or None)
        batch, rows, prompt_rows, pool = self.build_batch(out)
        self.check_batch(batch)  # before the workers see it: a bad batch stops here, on every rank
        if self.channel is not None:  # the workers start on the step while the driver does too
            self.channel.send_step(block_ops, batch)
        logits = self.run_batch(block_ops, batch, checked=True, pool=pool)
        prompt = None
        if prompt_rows:
            logits, prompt = logits[:len(rows)], PromptLogits(prompt_rows, logits[len(rows):])
        if any(s.is_fork_point for s in rows):
            rows, repeats = self._expand_forks(rows)
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        return rows, logits, prompt

    @torch.inference_mode()
    def sample(self, rows: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        """One token per row of `logits` (float32 [len(rows), vocab])."""
        return self.sampler(logits, self.sampling_batch(rows))

    @torch.inference_mode()
    def sample_each(self, rows: list[Sequence], logits: torch.Tensor) -> tuple[SamplerOutput, list[Exception | None]]:
        """Samples row by row, after a batched `sample` raised: finds the rows at fault.

        Returns the tokens (a failed row gets -1, and None logprobs) and, per row, the error it raised or None.
        """
        tokens: list[int] = []
        logprobs: list = []
        errors: list[Exception | None] = []
        for i, seq in enumerate(rows):
            try:
                one = self.sample([seq], logits[i:i + 1])
            except Exception as e:  # this row's own parameters or state: only its request fails
                tokens.append(-1)
                logprobs.append(None)
                errors.append(e)
                continue
            tokens.extend(one.token_ids)
            logprobs.extend(one.logprobs)
            errors.append(None)
        return SamplerOutput(tokens, logprobs), errors

    @staticmethod
    def _expand_forks(rows: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A prompt sampled for the first time with n > 1: one row per sample, all from its logits."""
        expanded: list[Sequence] = []
        repeats: list[int] = []
        for s in rows:
            if s.is_fork_point:
                expanded.extend(s.request.seqs)
                repeats.append(len(s.request.seqs))
            else:
                expanded.append(s)
                repeats.append(1)
        return expanded, repeats

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_sampled: int) -> None:
        """A forward at the step's largest size on scratch blocks: measures the activation peak (and warms up).

        Uses sequences of up to max_model_len tokens, all prefill, writing only
        to blocks the caller can spare (slot_mapping -1: skipped).
        """
        cfg = self.model.config
        seq_len = min(num_tokens, self.max_blocks_per_seq * self.block_size)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        dev = self.device
        n = len(lens)
        width = -(-seq_len // self.block_size)
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens).cumsum(0)
        meta = AttentionMetadata(
            num_decode_tokens=0, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            decode_block_tables=torch.zeros(0, width, dtype=torch.int32, device=dev),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=dev), decode_max_seq_len=0,
            num_prefills=n, prefill_block_tables=torch.zeros(n, width, dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            prefill_query_start_loc=qsl.to(dev), prefill_max_query_len=max(lens), prefill_max_seq_len=max(lens))
        ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=dev)
        pos = torch.cat([torch.arange(x, device=dev) for x in lens])
        hidden = self.model(ids, pos, self.kv_caches, meta)
        rows = torch.arange(min(num_sampled, num_tokens), device=dev)
        self.model.compute_logits(hidden.index_select(0, rows))


def profile_activation_peak(model: CausalLM, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                            dtype: torch.dtype, device: torch.device, seed: int) -> int:
    """CUDA bytes a forward of max_num_batched_tokens tokens needs beyond the weights (on one scratch block).

    Under tensor parallelism every rank runs it at the same time (the forward's collectives pair up).
    """
    cc, sc = cache_config, scheduler_config
    probe = ModelRunner(model, BlockManager(cc.block_size, 1), cc, sc, 1, 0, dtype, device, seed)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe.profile_run(sc.max_num_batched_tokens, sc.max_num_seqs)
    peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return peak
