// Prompt lookup decoding (the n-gram proposer of vLLM and of Saxena's PLD), the baseline the
// suffix engine is compared with: the k tokens that followed the most recent earlier occurrence
// of the longest context suffix of length max_n, max_n - 1, ..., min_n.
#pragma once

#include <cstddef>
#include <cstdint>

#include "drafter.h"

namespace agentaccel {

Draft prompt_lookup(const uint32_t* context, size_t n, int min_n, int max_n, int k);

}  // namespace agentaccel
