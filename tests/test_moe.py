"""The fused mixture-of-experts op and layer (pagedkv.model.moe).

- `ops.fused_moe` against `reference.fused_moe` on fresh random inputs: T=1 and
  odd sizes, E=8 top-2 and E=16 top-4, experts that get no tokens, every token
  on one expert, I not a multiple of 16; float32 tight, bfloat16 looser.
- `FusedMoE` against HF's MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock
  (tiny, seeded), their weights copied in through `load_expert_weight`, in both
  the in-memory stacked names and the per-expert names save_pretrained writes.
- Tensor-parallel size 2 (two processes over gloo) equals size 1.
- Bad inputs: errors that say what was expected and what was given.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from pagedkv import ops, reference
from pagedkv.model import moe as moe_mod
from pagedkv.model.moe import FusedMoE, expert_params_mapping, looped_experts

TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _weights(num_experts, hidden, inter, dtype, gen):
    """w13 [E, 2I, H], w2 [E, H, I] scaled so activations stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def _inputs(T, E, K, H, inter, dtype, seed=0, ids=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    w13, w2 = _weights(E, H, inter, dtype, gen)
    weights, topk_ids = reference.moe_routing(torch.randn(T, E, generator=gen), K, renormalize=True)
    if ids is not None:
        topk_ids = ids
    return hidden, w13, w2, weights, topk_ids


def _assert_close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


# ---- the op against the reference -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,H,inter", [(1, 8, 2, 64, 48), (37, 8, 2, 64, 56), (37, 16, 4, 96, 40),
                                       (5, 16, 4, 32, 17), (64, 4, 1, 48, 30), (6, 4, 2, 1024, 24)])
def test_op_matches_reference(T, E, K, H, inter, dtype):
    args = _inputs(T, E, K, H, inter, dtype, seed=T * 100 + E)
    _assert_close(ops.fused_moe(*args), reference.fused_moe(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_tokens_and_all_tokens_on_one_expert(dtype):
    T, E, K = 19, 8, 2
    # Slot 0 always expert 5, slot 1 expert 2 or 6: five experts get nothing.
    ids = torch.stack([torch.full((T,), 5), torch.tensor([2, 6] * 10)[:T]], dim=1)
    args = _inputs(T, E, K, 40, 24, dtype, ids=ids)
    _assert_close(ops.fused_moe(*args), reference.fused_moe(*args), dtype)
    single = _inputs(T, E, 1, 40, 24, dtype, ids=torch.full((T, 1), 7))
    _assert_close(ops.fused_moe(*single), reference.fused_moe(*single), dtype)


def test_int32_ids_bf16_weights_and_non_contiguous_hidden():
    hidden, w13, w2, weights, ids = _inputs(23, 8, 2, 64, 40, torch.bfloat16)
    want = reference.fused_moe(hidden, w13, w2, weights, ids)
    strided = torch.cat([hidden, hidden], dim=1)[:, :64]
    got = ops.fused_moe(strided, w13, w2, weights.to(torch.bfloat16), ids.to(torch.int32))
    _assert_close(got, want, torch.bfloat16)


PACKERS = {"onednn": lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1), "pagedkv": ops.pack_linear_weight}
VARIANTS = ops.runnable_cpu_capabilities()


def _packed(w, kernel="onednn"):
    return [PACKERS[kernel](w[e]) for e in range(w.shape[0])]


def _skip_without_onednn_bf16(kernel, dtype):
    if kernel == "onednn" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs bf16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")


@pytest.mark.parametrize("kernel", ["onednn", "pagedkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (37, 8, 2), (37, 16, 4)])
def test_op_with_packed_weights_matches_reference(T, E, K, dtype, kernel):
    """Every expert with rows runs on its packed weight; the plain ones are zero placeholders, never read."""
    _skip_without_onednn_bf16(kernel, dtype)
    hidden, w13, w2, weights, ids = _inputs(T, E, K, 64, 40, dtype, seed=T + E)
    want = reference.fused_moe(hidden, w13, w2, weights, ids)
    packs = _packed(w13, kernel), _packed(w2, kernel)
    placeholders = [w.new_zeros(()).expand(w.shape) for w in (w13, w2)]
    _assert_close(ops.fused_moe(hidden, *placeholders, weights, ids, *packs), want, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,H,inter", [(37, 8, 2, 72, 53), (300, 4, 1, 50, 31)])
def test_op_on_pagedkv_packed_weights_under_every_variant(variant, dtype, T, E, K, H, inter):
    """pagedkv's GEMM in each CPU variant, odd sizes (a last panel and bf16 pair half empty); the experts as one
    grouped product with few rows each (T=37) and with row blocks of their own (T=300: 75 rows an expert)."""
    hidden, w13, w2, weights, ids = _inputs(T, E, K, H, inter, dtype, seed=T + H)
    want = reference.fused_moe(hidden, w13, w2, weights, ids)
    previous = ops.set_cpu_capability(variant)
    try:
        got = ops.fused_moe(hidden, w13, w2, weights, ids, _packed(w13, "pagedkv"), _packed(w2, "pagedkv"))
    finally:
        ops.set_cpu_capability(previous)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_with_uneven_rows(dtype):
    """The grouped product deals tasks of very different cost to the threads: one expert has every token
    (259 rows: two row blocks; bf16 widens its panels), the others a few rows each, three none."""
    T, E = 259, 16
    slot0 = torch.full((T,), 11)
    slot1 = torch.arange(T) % 5                  # experts 0-4
    slot2 = (torch.arange(T) * 7) % 8 + 5       # experts 5-12, 11 among them
    slot2 = torch.where(slot2 == 11, 12, slot2)  # a token's slots name distinct experts
    hidden, w13, w2, weights, ids = _inputs(T, E, 3, 40, 29, dtype, ids=torch.stack([slot0, slot1, slot2], dim=1))
    want = reference.fused_moe(hidden, w13, w2, weights, ids)
    got = ops.fused_moe(hidden, w13, w2, weights, ids, _packed(w13, "pagedkv"), _packed(w2, "pagedkv"))
    _assert_close(got, want, dtype)


def test_packings_mixed_within_one_list():
    """Experts packed for pagedkv (run as one grouped product) beside experts packed by oneDNN (run one by one)
    in the same list give the plain op's result."""
    args = _inputs(29, 8, 2, 48, 40, torch.float32, seed=11)
    hidden, w13, w2, weights, ids = args
    onednn = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1)  # noqa: E731
    mixed13 = [onednn(w13[e]) if e % 2 else ops.pack_linear_weight(w13[e]) for e in range(8)]
    mixed2 = [ops.pack_linear_weight(w2[e]) if e % 3 else onednn(w2[e]) for e in range(8)]
    _assert_close(ops.fused_moe(hidden, w13, w2, weights, ids, mixed13, mixed2), ops.fused_moe(*args), torch.float32)


def test_mixed_packings_and_plain_agree():
    """oneDNN-packed w13 with pagedkv-packed w2, and the reverse, give the plain op's result."""
    args = _inputs(23, 8, 2, 48, 40, torch.float32, seed=7)
    hidden, w13, w2, weights, ids = args
    want = ops.fused_moe(*args)
    for kernels in (("onednn", "pagedkv"), ("pagedkv", "onednn")):
        got = ops.fused_moe(hidden, w13, w2, weights, ids, _packed(w13, kernels[0]), _packed(w2, kernels[1]))
        _assert_close(got, want, torch.float32)


def test_packed_weights_must_be_one_per_expert_and_fit():
    hidden, w13, w2, weights, ids = _inputs(9, 8, 2, 32, 24, torch.float32)
    with pytest.raises(RuntimeError, match=r"w13_packed must hold one packed weight per expert \(8\), got 2"):
        ops.fused_moe(hidden, w13, w2, weights, ids, _packed(w13)[:2], _packed(w2))
    with pytest.raises(RuntimeError, match=r"every w2_packed entry must be a CPU Float tensor"):
        ops.fused_moe(hidden, w13, w2, weights, ids, None, [w.to(torch.bfloat16) for w in w2])
    # w2's packing given as w13's: the wrong weight shape for either packing.
    with pytest.raises(RuntimeError, match=r"w13_packed\[0\] must be a \[48, 32\] expert weight packed by "
                                           r"pack_linear_weight \(shape \[1, 32, 48\], contiguous\).*got shape "
                                           r"\[1, 24, 48\]"):
        ops.fused_moe(hidden, w13, w2, weights, ids, _packed(w2, "pagedkv"), None)
    with pytest.raises(RuntimeError, match=r"w2_packed\[0\] must be a \[32, 24\] expert weight.*"
                                           r"_reorder_linear_weight \(shape \[32, 24\]\), got shape \[48, 32\]"):
        ops.fused_moe(hidden, w13, w2, weights, ids, None, [w.clone() for w in w13])
    strided = [torch.cat([p, p], dim=-1)[..., :48] for p in _packed(w13, "pagedkv")]  # rows of 96, not 48
    with pytest.raises(RuntimeError, match=r"w13_packed\[0\] must be .*contiguous"):
        ops.fused_moe(hidden, w13, w2, weights, ids, strided, None)


def test_zero_tokens():
    hidden, w13, w2, weights, ids = _inputs(0, 8, 2, 32, 16, torch.float32)
    assert ops.fused_moe(hidden, w13, w2, weights, ids).shape == (0, 32)


def test_looped_experts_match_reference():
    args = _inputs(37, 16, 4, 48, 40, torch.float32)
    _assert_close(looped_experts(*args), reference.fused_moe(*args), torch.float32)


def test_opcheck_fused_moe():
    args = _inputs(9, 8, 2, 32, 24, torch.float32)
    torch.library.opcheck(torch.ops.pagedkv.fused_moe.default, args)


def test_routing_matches_hand_computation():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = reference.moe_routing(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]]
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(weights[0], torch.stack([p[1], p[2]]) / (p[1] + p[2]))
    unnorm, _ = reference.moe_routing(logits, 2, renormalize=False)
    torch.testing.assert_close(unnorm[0], torch.stack([p[1], p[2]]))
    w2, ids2 = moe_mod.select_experts(logits, 2, True)
    assert torch.equal(ids2, ids) and torch.allclose(w2, weights)


# ---- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(4, a[4] + 8), r"topk_ids must be in \[0, 8\), got \d+ at \[0, 0\]"),
    (lambda a: a.__setitem__(4, a[4] - 9), r"topk_ids must be in \[0, 8\), got -\d+"),
    (lambda a: a.__setitem__(0, a[0][:, :16]), r"w13 must be \[num_experts, 2 \* intermediate, 16\]"),
    (lambda a: a.__setitem__(2, a[2][:, :, :8]), r"w2 must be \[8, 32, 24\]"),
    (lambda a: a.__setitem__(1, a[1].to(torch.bfloat16)), r"w13 and w2 must have hidden's dtype Float"),
    (lambda a: a.__setitem__(4, a[4].float()), r"topk_ids must be int32 or int64, got Float"),
    (lambda a: a.__setitem__(3, a[3][:, :1]), r"topk_weights must have topk_ids' shape"),
    (lambda a: a.__setitem__(4, a[4][:3]), r"topk_ids must be \[num_tokens=9, top_k >= 1\]"),
    (lambda a: a.__setitem__(0, a[0][0]), r"hidden must be 2-D \[num_tokens, hidden_size\]"),
    (lambda a: a.__setitem__(1, a[1][:, :47]), r"w13's dim 1 must be 2 \* intermediate"),
])
def test_bad_inputs_are_refused_clearly(change, message):
    args = list(_inputs(9, 8, 2, 32, 24, torch.float32))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.fused_moe(*args)


def test_meta_and_real_tensors_are_not_mixed():
    hidden, w13, w2, weights, ids = _inputs(3, 4, 2, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="hidden is on cpu but other arguments are on meta"):
        ops.fused_moe(hidden, w13.to("meta"), w2.to("meta"), weights.to("meta"), ids)
    out = ops.fused_moe(hidden.to("meta"), w13.to("meta"), w2.to("meta"), weights.to("meta"), ids.to("meta"))
    assert out.shape == (3, 16) and out.device.type == "meta"


def test_layer_refuses_bad_config_and_bad_checkpoint_tensors():
    with pytest.raises(ValueError, match=r"top_k \(num_experts_per_tok\) must be in \[1, num_experts=4\]"):
        FusedMoE(4, 5, 16, 8)
    layer = FusedMoE(4, 2, 16, 8)
    with pytest.raises(ValueError, match=r"expected 8 along dim 0"):
        layer.load_expert_weight("experts.0.w1.weight", torch.zeros(9, 16))
    with pytest.raises(ValueError, match=r"expected 4 along dim 0 \(does config.json match"):
        layer.load_expert_weight("experts.gate_up_proj", torch.zeros(3, 16, 16))
    with pytest.raises(ValueError, match=r"does not fit a per-expert 2-D down projection"):
        layer.load_expert_weight("experts.1.w2.weight", torch.zeros(4, 16, 8))
    assert not layer.load_expert_weight("experts.4.w1.weight", torch.zeros(8, 16))  # no expert 4
    assert not layer.load_expert_weight("self_attn.q_proj.weight", torch.zeros(8, 16))


# ---- the layer against HF -------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _hf_block(kind: str, seed: int = 0, **overrides):
    """A tiny seeded HF sparse-MoE block, float32, eval, with non-trivial random weights."""
    torch.manual_seed(seed)
    common = dict(hidden_size=48, num_experts_per_tok=2, hidden_act="silu", num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = transformers.MixtralConfig(intermediate_size=40, num_local_experts=8, **common | overrides)
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=40, num_experts=16,
                                          **common | {"num_experts_per_tok": 4, "norm_topk_prob": True} | overrides)
        block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block.float().eval(), cfg


def _layer_for(kind: str, cfg) -> FusedMoE:
    if kind == "mixtral":
        return FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                        renormalize=True)
    return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                    renormalize=cfg.norm_topk_prob)


def _per_expert_names(kind: str, block) -> dict[str, torch.Tensor]:
    """The names and tensors HF's save_pretrained writes for the block (per expert)."""
    gate, up = block.experts.gate_up_proj.detach().chunk(2, dim=1)
    down = block.experts.down_proj.detach()
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {"gate.weight": block.gate.weight.detach()}
    for e in range(gate.shape[0]):
        for name, t in zip(names, (gate[e], up[e], down[e]), strict=True):
            out[f"experts.{e}.{name}.weight"] = t.clone()
    return out


def _stacked_names(block) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in block.state_dict().items()}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("names", ["per_expert", "stacked"])
@pytest.mark.parametrize("path", ["fused", "fused+pagedkv", "fused+onednn", "loop"])
def test_layer_matches_hf_block(kind, names, path, monkeypatch):
    monkeypatch.setattr(moe_mod, "_fused_moe", path != "loop")
    monkeypatch.setenv("PAGEDKV_CPU_LINEAR_KERNEL", path.removeprefix("fused+") if "+" in path else "auto")
    block, cfg = _hf_block(kind)
    layer = _layer_for(kind, cfg)
    tensors = _per_expert_names(kind, block) if names == "per_expert" else _stacked_names(block)
    assert all(layer.load_expert_weight(n, t) for n, t in tensors.items())
    if "+" in path:
        layer.pack_for_cpu()
        assert layer.packed is not None and len(layer.packed[0]) == layer.num_experts
        assert layer.packed[0][0].dim() == (2 if path == "fused+onednn" else 3)  # oneDNN keeps [out, in]
    for T in (1, 37):
        x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            want = block(x[None])[0]
            got = layer(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_bf16_layer_with_packed_experts_is_close_to_hf(kind):
    """bf16: HF's block and ours round differently (Qwen3-MoE's routing weights, our fp32 combine)."""
    block, cfg = _hf_block(kind, seed=5)
    layer = _layer_for(kind, cfg)
    for n, t in _stacked_names(block).items():
        layer.load_expert_weight(n, t)
    block, layer = block.to(torch.bfloat16), layer.to(torch.bfloat16)
    layer.pack_for_cpu()
    x = torch.randn(29, cfg.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        want, got = block(x[None])[0].float(), layer(x).float()
    # Near-tied router logits can pick a different expert in bf16: compare where the routing agrees.
    ids_hf = block.gate(x)[2]
    ids_ours = moe_mod.select_experts(layer.gate(x), layer.top_k, layer.renormalize)[1]
    same = (ids_hf.sort(-1).values == ids_ours.sort(-1).values).all(-1)
    assert same.sum() >= 20
    torch.testing.assert_close(got[same], want[same], atol=5e-2 * want.abs().max().item(), rtol=5e-2)


def test_qwen3_moe_without_renormalization_matches_hf():
    block, cfg = _hf_block("qwen3_moe", seed=3, norm_topk_prob=False)
    layer = _layer_for("qwen3_moe", cfg)
    assert not layer.renormalize
    for n, t in _stacked_names(block).items():
        assert layer.load_expert_weight(n, t)
    x = torch.randn(13, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), block(x[None])[0], atol=1e-5, rtol=1e-5)


def test_save_pretrained_checkpoint_loads_through_lazy_slices(tmp_path):
    """What transformers' save_pretrained writes (per-expert names), read lazily as the loader does."""
    from pagedkv.model.loader import iter_safetensors
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path)
    layer = FusedMoE(4, 2, 32, 24)
    prefix = "model.layers.0.block_sparse_moe."
    taken = [name for name, t in iter_safetensors(tmp_path, lazy=True)
             if name.startswith(prefix) and layer.load_expert_weight(name.removeprefix(prefix), t)]
    assert len(taken) == 1 + 3 * 4
    x = torch.randn(7, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), model.model.layers[0].mlp(x[None])[0], atol=1e-5, rtol=1e-5)


def test_expert_params_mapping_lists_every_name():
    names = {n for n, _, _ in expert_params_mapping(2)}
    assert {"experts.1.w1.weight", "experts.1.w3.weight", "experts.1.w2.weight", "experts.0.gate_proj.weight",
            "experts.0.up_proj.weight", "experts.0.down_proj.weight", "experts.gate_up_proj",
            "experts.down_proj"} <= names
    assert len(names) == 2 * 6 + 2


# ---- tensor parallelism -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank: int, port: int, path: str) -> None:
    import torch.distributed as dist
    from pagedkv.model.parallel_state import init_tensor_parallel, reset_tensor_parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    init_tensor_parallel(rank, 2)
    try:
        data = torch.load(path)
        layer = FusedMoE(16, 4, 48, 40)
        assert layer.w13.shape == (16, 40, 48) and layer.w2.shape == (16, 48, 20)
        for n, t in data["tensors"].items():
            assert layer.load_expert_weight(n, t)
        with torch.no_grad():
            out = layer(data["x"])
        if rank == 0:
            torch.save(out, path + ".out")
    finally:
        reset_tensor_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("names", ["per_expert", "stacked"])
def test_tensor_parallel_size_2_equals_size_1(tmp_path, names):
    block, cfg = _hf_block("qwen3_moe", seed=1)
    tensors = _per_expert_names("qwen3_moe", block) if names == "per_expert" else _stacked_names(block)
    x = torch.randn(21, cfg.hidden_size)
    single = _layer_for("qwen3_moe", cfg)
    for n, t in tensors.items():
        single.load_expert_weight(n, t)
    with torch.no_grad():
        want = single(x)
    path = str(tmp_path / "moe_tp.pt")
    torch.save({"tensors": tensors, "x": x}, path)
    mp.start_processes(_tp_rank, args=(_free_port(), path), nprocs=2, join=True, start_method="spawn")
    torch.testing.assert_close(torch.load(path + ".out"), want, atol=1e-5, rtol=1e-5)


def test_intermediate_size_must_divide_by_tp(monkeypatch):
    monkeypatch.setattr(moe_mod, "get_tp_size", lambda: 3)
    with pytest.raises(ValueError, match=r"intermediate size \(40\) is not divisible by the tensor-parallel size 3"):
        FusedMoE(4, 2, 16, 40)
