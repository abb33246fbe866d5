// The lines of a prompt as the template miner (agentaccel/traces/template_miner.py) reads them:
// split at '\n' or '\r', blank lines skipped, every run of ASCII digits read as one '0' (numbers
// are slot content: ids, dates, counts), at most `max_bytes` of the text. Native because the miner
// reads every untagged request on the proxy's event loop: a hash per line is its whole view of a call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace agentaccel {

// A 64-bit hash of each line, the same across processes and restarts (not Python's salted hash).
std::vector<uint64_t> line_hashes(std::string_view text, size_t max_bytes);

// The same lines as text (digits masked), for the templates a miner keeps and shows.
std::vector<std::string> masked_lines(std::string_view text, size_t max_bytes);

}  // namespace agentaccel
