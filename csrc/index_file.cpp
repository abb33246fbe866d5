#include "index_file.h"

#include <algorithm>

namespace agentaccel {

namespace {
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
}  // namespace

void Checksum::block(const char* p) {
  for (int k = 0; k < 4; ++k) {
    uint64_t w;
    std::memcpy(&w, p + 8 * k, 8);
    v_[k] = rotl(v_[k] + w * P2, 31) * P1;
  }
}

void Checksum::update(const char* data, size_t n) {
  total_ += n;
  if (carried_ > 0) {
    size_t take = std::min(n, 32 - carried_);
    std::memcpy(carry_ + carried_, data, take);
    carried_ += take;
    data += take;
    n -= take;
    if (carried_ < 32) return;
    block(carry_);
    carried_ = 0;
  }
  for (; n >= 32; data += 32, n -= 32) block(data);
  std::memcpy(carry_, data, n);
  carried_ = n;
}

uint64_t Checksum::finish() const {
  uint64_t h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18) + total_;
  for (size_t i = 0; i < carried_; ++i) h = rotl(h ^ (uint8_t(carry_[i]) * P3), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  return h;
}

uint64_t checksum(const char* data, size_t n) {
  Checksum c;
  c.update(data, n);
  return c.finish();
}

void IndexWriter::append(const void* data, size_t n) {
  if (n == 0) return;
  sum_.update(static_cast<const char*>(data), n);
  size_ += n;
  ok_ = ok_ && std::fwrite(data, 1, n, file_) == n;
}

void IndexWriter::pad(size_t align) {
  static const char zeros[64] = {};
  append(zeros, (align - size_ % align) % align);
}

}  // namespace agentaccel
