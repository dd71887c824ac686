// Op schemas (schema-first, with mutation annotations) and the CPU
// implementations. CUDA implementations register in csrc/cuda/.
#include <Python.h>
#include <torch/library.h>

#include "common/validation.h"
#include "cpu/cpu_capability.h"
#include "cpu/cpu_threads.h"
#include "ops.h"

TORCH_LIBRARY(pagedkv, m) {
  m.def(
      "paged_attention_v1(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int max_seq_len, Tensor? alibi_slopes=None, "
      "int sliding_window=0, float logits_soft_cap=0.0, str kv_cache_dtype=\"auto\", Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> ()");
  m.def(
      "paged_attention_v2(Tensor(a!) out, Tensor(b!) exp_sums, Tensor(c!) max_logits, Tensor(d!) tmp_out, "
      "Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "int max_seq_len, Tensor? alibi_slopes=None, int partition_size=512, int sliding_window=0, "
      "float logits_soft_cap=0.0, str kv_cache_dtype=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int? max_seq_len=None, Tensor? alibi_slopes=None, int sliding_window=0, "
      "float logits_soft_cap=0.0, str kv_cache_dtype=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int max_query_len, "
      "int max_seq_len, int sliding_window=0, float logits_soft_cap=0.0, str kv_cache_dtype=\"auto\", "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype=\"auto\", Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping, "
      "Tensor(c!)[]? key_scales=None, Tensor(d!)[]? value_scales=None) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // Fused per-layer ops of the decoder (vLLM's semantics and argument order).
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def(
      "rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, Tensor cos_sin_cache, "
      "bool is_neox=True, str kv_cache_dtype=\"auto\", Tensor(e!)? k_scale=None, Tensor(f!)? v_scale=None) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // Mixture-of-experts with SwiGLU experts, top-k routing already chosen (pagedkv.model.moe).
  m.def(
      "fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
      "Tensor[]? w13_packed=None, Tensor[]? w2_packed=None) -> Tensor");
  // The CPU linear layer on a weight packed once into column panels (csrc/cpu/gemm_kernels.h).
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor(a!) out, Tensor input, Tensor packed_weight, Tensor? bias=None) -> ()");
  // The next token of each row: greedy or an inverse-CDF draw at a given uniform (pagedkv.model.sampler).
  m.def("sample_from_logits(Tensor(a!) out, Tensor logits, Tensor temperatures, Tensor uniforms) -> ()");
  // Structured outputs: each masked row's forbidden tokens (0 bits of its int32 words) get -inf.
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  // Multi-LoRA: each adapter slot's rows of out += (input @ lora_a[s]^T) @ lora_b[s]^T, per slice (csrc/lora/lora.cpp).
  m.def(
      "lora_linear_add(Tensor(a!) out, Tensor input, Tensor lora_a, Tensor lora_b, Tensor token_rows, "
      "Tensor slot_starts, int[] slice_offsets) -> ()");
  // Which CPU kernel variant runs here: "default", "avx2", "avx512" or "avx512_bf16", and a
  // switch between them for tests and benchmarks (no tensors, no dispatch).
  m.def("cpu_capability() -> str", &pagedkv::cpu::cpu_capability_op);
  m.def("set_cpu_capability(str name) -> str", &pagedkv::cpu::set_cpu_capability_op);
  // Whether bf16 GEMMs of many rows run on AMX tiles, and the switch (cpu_capability.h).
  m.def("cpu_amx() -> bool", [] { return pagedkv::cpu::cpu_amx_enabled(); });
  m.def("set_cpu_amx(bool enabled) -> bool", [](bool enabled) { return pagedkv::cpu::set_cpu_amx_op(enabled); });
  m.def("cpu_bf16_dot() -> bool", [] { return pagedkv::cpu::cpu_bf16_dot_enabled(); });
  m.def("set_cpu_bf16_dot(bool enabled) -> bool",
        [](bool enabled) { return pagedkv::cpu::set_cpu_bf16_dot_op(enabled); });
  // Binds torch's OpenMP compute threads one per CPU (engine/cpu_binding.py). No tensors, no dispatch.
  m.def("bind_cpu_threads(int[] cpus) -> int[]",
        [](std::vector<int64_t> cpus) { return pagedkv::cpu::bind_cpu_threads(cpus); });
  // The runtime toggle of the index-value checks (common/validation.h); wrapped by
  // pagedkv.ops.set_index_checks / index_checks. No tensors, no dispatch.
  m.def("set_index_checks(bool enabled) -> bool", [](bool enabled) { return pagedkv::set_index_checks(enabled); });
  m.def("index_checks_enabled() -> bool", [] { return pagedkv::index_checks_enabled(); });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention_v1", &pagedkv::paged_attention_v1_cpu);
  m.impl("paged_attention_v2", &pagedkv::paged_attention_v2_cpu);
  m.impl("paged_prefill_attention", &pagedkv::paged_prefill_attention_cpu);
  m.impl("reshape_and_cache", &pagedkv::reshape_and_cache_cpu);
  m.impl("copy_blocks", &pagedkv::copy_blocks_cpu);
  m.impl("swap_blocks", &pagedkv::swap_blocks_cpu);
  m.impl("rms_norm", &pagedkv::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &pagedkv::silu_and_mul_cpu);
  m.impl("gelu_and_mul", &pagedkv::gelu_and_mul_cpu);
  m.impl("gelu_tanh_and_mul", &pagedkv::gelu_tanh_and_mul_cpu);
  m.impl("rotary_embedding_and_cache", &pagedkv::rotary_embedding_and_cache_cpu);
  m.impl("fused_moe", &pagedkv::fused_moe_cpu);
  m.impl("pack_linear_weight", &pagedkv::pack_linear_weight_cpu);
  m.impl("packed_linear", &pagedkv::packed_linear_cpu);
  m.impl("sample_from_logits", &pagedkv::sample_from_logits_cpu);
  m.impl("apply_token_bitmask", &pagedkv::apply_token_bitmask_cpu);
}

// paged_attention only allocates and calls v1/v2 through the dispatcher, and lora_linear_add
// is ATen calls only, so one kernel serves every backend; their fake kernels are registered in
// python/pagedkv/ops.py.
TORCH_LIBRARY_IMPL(pagedkv, CompositeExplicitAutograd, m) {
  m.impl("paged_attention", &pagedkv::paged_attention);
  m.impl("lora_linear_add", &pagedkv::lora_linear_add);
}

// `import pagedkv._C` loads this library, which runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "pagedkv compiled ops (torch.ops.pagedkv.*)", -1,
                               nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
#ifdef PAGEDKV_WITH_CUDA
  PyModule_AddIntConstant(m, "built_with_cuda", 1);
#else
  PyModule_AddIntConstant(m, "built_with_cuda", 0);
#endif
  return m;
}
