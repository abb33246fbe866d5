#include "prompt_lookup.h"

#include <algorithm>
#include <cstring>

namespace agentaccel {

Draft prompt_lookup(const uint32_t* context, size_t n, int min_n, int max_n, int k) {
  Draft d;
  for (int len = std::min<int>(max_n, int(n) - 1); len >= std::max(min_n, 1); --len) {
    const uint32_t* pattern = context + n - len;
    // Scan backwards: the most recent occurrence is the most relevant in a growing trajectory.
    for (size_t start = n - len; start-- > 0;) {
      if (context[start] != pattern[0] || std::memcmp(context + start, pattern, len * sizeof(uint32_t)) != 0) continue;
      size_t from = start + len;
      size_t take = std::min<size_t>(k, n - from);
      for (size_t i = 0; i < take; ++i) {
        d.tokens.push_back(context[from + i]);
        d.parents.push_back(int32_t(i) - 1);
        d.probs.push_back(1.0);
      }
      d.score = double(take);
      d.match_len = len;
      d.source = take ? "prompt-lookup" : "";
      return d;
    }
  }
  return d;
}

}  // namespace agentaccel
