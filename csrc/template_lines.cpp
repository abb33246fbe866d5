#include "template_lines.h"

#include <cstring>

namespace agentaccel {
namespace {

constexpr uint64_t kOffset = 1469598103934665603ULL;
constexpr uint64_t kPrime = 0x9e3779b97f4a7c15ULL;  // odd, well spread

inline bool is_digit(unsigned char c) { return static_cast<unsigned char>(c - '0') < 10; }
inline bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\f' || c == '\v'; }

uint64_t mix(uint64_t h) {  // splitmix64's finaliser
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

// Eight bytes at a time: a byte-wise hash is bound by the multiply's latency.
uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = kOffset ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * kPrime;
    h ^= h >> 29;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, n - i);
  return mix(h ^ tail);
}

size_t count_digits(const char* p, size_t n) {  // a loop without early exit: the compiler vectorises it
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += is_digit(static_cast<unsigned char>(p[i]));
  return count;
}

// Calls emit(line, length) for each non-blank line of text[0, max_bytes), split at '\n' or '\r'.
template <class Emit>
void for_each_line(std::string_view text, size_t max_bytes, Emit emit) {
  size_t n = text.size() < max_bytes ? text.size() : max_bytes;
  while (n < text.size() && n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;  // whole UTF-8 chars
  const char* p = text.data();
  const char* end = p + n;
  while (p < end) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', size_t(end - p)));
    const char* stop = nl ? nl : end;
    while (p < stop) {
      const char* cr = static_cast<const char*>(std::memchr(p, '\r', size_t(stop - p)));
      const char* line_end = cr ? cr : stop;
      const char* q = p;
      while (q < line_end && is_space(static_cast<unsigned char>(*q))) ++q;
      if (q < line_end) emit(p, size_t(line_end - p));
      p = line_end + (cr ? 1 : 0);
    }
    p = stop + 1;
  }
}

// The line with every run of digits written as one '0'.
void mask(const char* p, size_t n, std::string& line) {
  line.clear();
  bool in_number = false;
  for (size_t i = 0; i < n; ++i) {
    const bool digit = is_digit(static_cast<unsigned char>(p[i]));
    if (!digit || !in_number) line.push_back(digit ? '0' : p[i]);
    in_number = digit;
  }
}

}  // namespace

std::vector<uint64_t> line_hashes(std::string_view text, size_t max_bytes) {
  std::vector<uint64_t> out;
  std::string masked;
  for_each_line(text, max_bytes, [&](const char* p, size_t n) {
    if (count_digits(p, n) == 0) {
      out.push_back(hash_bytes(p, n));
    } else {
      mask(p, n, masked);
      out.push_back(hash_bytes(masked.data(), masked.size()));
    }
  });
  return out;
}

std::vector<std::string> masked_lines(std::string_view text, size_t max_bytes) {
  std::vector<std::string> out;
  for_each_line(text, max_bytes, [&](const char* p, size_t n) {
    out.emplace_back();
    mask(p, n, out.back());
  });
  return out;
}

}  // namespace agentaccel
