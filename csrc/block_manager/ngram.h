// N-gram (prompt lookup) draft proposer for speculative decoding.
//
// A sequence often repeats itself (code, quoted documents, lists): the tokens
// that followed an earlier occurrence of its last few tokens are a cheap
// guess at what comes next. No draft model is needed; the target model
// verifies the guess in one forward pass. The rule is the same as vLLM's
// ngram proposer; python/pagedkv/spec_decode/ngram.py holds a brute-force
// twin that the tests compare against.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedkv {

// Proposes up to `k` draft tokens for a sequence whose whole context (prompt
// + output so far) is tokens[0, num_tokens). With L = num_tokens:
//   - find the longest n in [min_n, max_n] such that the suffix tokens[L-n, L)
//     also occurs earlier, as tokens[j, j+n) with j + n < L (an occurrence may
//     overlap the suffix, but may not be the suffix itself);
//   - among the occurrences of that n take the earliest (smallest j);
//   - return tokens[j+n, j+n+kk), kk = min(k, max_len - L), clipped at L.
// Empty when L < min_n, when no n matches, or when kk <= 0 (the sequence is
// at the model's max length `max_len`: no draft could be kept).
// O(L * max_n) time in the worst case, usually about L token comparisons;
// allocates only the result. Throws std::invalid_argument unless
// 1 <= min_n <= max_n, k >= 0, max_len >= 0 and num_tokens >= 0.
std::vector<int64_t> propose_ngram(const int64_t* tokens, int64_t num_tokens, int64_t min_n, int64_t max_n,
                                   int64_t k, int64_t max_len);

}  // namespace pagedkv
