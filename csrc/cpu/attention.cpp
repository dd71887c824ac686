// PLACEHOLDER (being replaced by the CPU kernel work): op entry points for CPU attention.
#include <ATen/ATen.h>
#include "ops.h"
namespace pagedkv {
void paged_attention_v1_cpu(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, int64_t, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "paged_attention_v1: CPU kernel not built yet");
}
void paged_attention_v2_cpu(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                            const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "paged_attention_v2: CPU kernel not built yet");
}
void paged_prefill_attention_cpu(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, int64_t) {
  TORCH_CHECK(false, "paged_prefill_attention: CPU kernel not built yet");
}
}  // namespace pagedkv
