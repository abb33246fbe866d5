// Writing an index file: bytes go to the file as they come, with a running checksum and the
// padding that lets arrays be used in place once mapped, so a save holds no second copy of the
// index in memory (it used to build the whole payload in a string first).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "errors.h"

namespace agentaccel {

// Reads a T at p and advances p; the reading side of IndexWriter::put.
template <class T>
T read_scalar(char*& p, const char* end) {
  if (size_t(end - p) < sizeof(T)) throw InvalidInput("truncated payload");
  T x;
  std::memcpy(&x, p, sizeof(T));
  p += sizeof(T);
  return x;
}

// xxHash64-style checksum over four independent lanes (several GB/s: loading stays I/O-bound),
// fed incrementally: update(a); update(b) gives the checksum of a + b.
class Checksum {
 public:
  void update(const char* data, size_t n);
  uint64_t finish() const;

 private:
  uint64_t v_[4] = {P1 + P2, P2, 0, 0 - P1};
  char carry_[32];           // bytes not yet making up a whole 32-byte block
  size_t carried_ = 0;
  uint64_t total_ = 0;
  static constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                            P3 = 1609587929392839161ULL;
  void block(const char* p);
};

uint64_t checksum(const char* data, size_t n);

class IndexWriter {
 public:
  explicit IndexWriter(FILE* file) : file_(file) {}
  void append(const void* data, size_t n);
  template <class T>
  void put(const T& x) {
    append(&x, sizeof(T));
  }
  // Zero bytes up to the next multiple of `align` counted from the payload's start.
  void pad(size_t align);
  uint64_t size() const { return size_; }
  uint64_t checksum() const { return sum_.finish(); }
  bool ok() const { return ok_; }

 private:
  FILE* file_;
  Checksum sum_;
  uint64_t size_ = 0;
  bool ok_ = true;
};

}  // namespace agentaccel
