#include "block_manager/ngram.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pagedkv {

namespace {

void check_args(int64_t num_tokens, int64_t min_n, int64_t max_n, int64_t k, int64_t max_len) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("propose_ngram: " + what); };
  if (min_n < 1) fail("min_n must be >= 1, got " + std::to_string(min_n));
  if (max_n < min_n) {
    fail("max_n must be >= min_n, got max_n=" + std::to_string(max_n) + " < min_n=" + std::to_string(min_n));
  }
  if (k < 0) fail("k must be >= 0, got " + std::to_string(k));
  if (max_len < 0) fail("max_len must be >= 0, got " + std::to_string(max_len));
  if (num_tokens < 0) fail("num_tokens must be >= 0, got " + std::to_string(num_tokens));
}

// How many tokens ending at `end` (inclusive) equal the sequence's last
// tokens, counted backwards and capped at `cap`.
int64_t match_length(const int64_t* tokens, int64_t num_tokens, int64_t end, int64_t cap) {
  const int64_t* last = tokens + num_tokens - 1;
  int64_t n = 0;
  while (n < cap && tokens[end - n] == last[-n]) ++n;
  return n;
}

}  // namespace

std::vector<int64_t> propose_ngram(const int64_t* tokens, int64_t num_tokens, int64_t min_n, int64_t max_n,
                                   int64_t k, int64_t max_len) {
  check_args(num_tokens, min_n, max_n, k, max_len);
  const int64_t num_drafts = std::min(k, max_len - num_tokens);
  if (num_tokens < min_n || num_drafts <= 0) return {};

  // Scan the possible ends of an earlier occurrence, left to right. An
  // occurrence of length n ending at `end` starts at end - n + 1, so for a
  // fixed n the first end found is the earliest occurrence: keeping the first
  // end with the largest length gives the earliest occurrence of the longest
  // n. The drafts start right after that end, whatever n is. `end` stops at
  // L - 2 (j + n < L excludes the suffix itself) and starts at min_n - 1
  // (an earlier end leaves no room for min_n tokens).
  int64_t best_len = min_n - 1;
  int64_t best_end = -1;
  for (int64_t end = min_n - 1; end + 1 < num_tokens; ++end) {
    const int64_t len = match_length(tokens, num_tokens, end, std::min(max_n, end + 1));
    if (len > best_len) {
      best_len = len;
      best_end = end;
      if (len == max_n) break;  // Nothing longer is allowed, nothing later is earlier.
    }
  }
  if (best_end < 0) return {};
  const int64_t first = best_end + 1;
  // Clipped at the end of the tokens; min before adding, as k may be huge.
  const int64_t count = std::min(num_drafts, num_tokens - first);
  return std::vector<int64_t>(tokens + first, tokens + first + count);
}

}  // namespace pagedkv
