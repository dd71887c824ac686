// The gated activations of the decoder MLP (silu_and_mul, gelu_and_mul, gelu_tanh_and_mul):
// out[t, i] = act(input[t, i]) * input[t, d + i], input [num_tokens, 2 d] = [gate | up].
// Plain types only: shared by the CPU kernels and the CUDA launchers.
#pragma once

#include <cstdint>

namespace pagedkv {

enum class GatedActivation : int8_t {
  kSilu,      // x / (1 + exp(-x)): SwiGLU (Llama, Qwen, Mistral, ...)
  kGelu,      // x / 2 * (1 + erf(x / sqrt 2)): GeGLU
  kGeluTanh,  // x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))): Gemma's GeGLU
};

}  // namespace pagedkv
