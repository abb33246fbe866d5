// Column<T>: the storage of every index array. It is either owned (a std::vector) or a view of
// a privately mapped index file, so that loading an index copies nothing: pages are read (and,
// when written, copied) by the kernel as they are touched. The first operation that changes the
// length of a view moves it to the heap.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace agentaccel {

template <class T>
class Column {
 public:
  Column() = default;
  Column(const Column&) = delete;
  Column& operator=(const Column&) = delete;
  Column(Column&& o) noexcept { *this = std::move(o); }
  Column& operator=(Column&& o) noexcept {
    own_ = std::move(o.own_);
    ptr_ = o.ptr_;
    size_ = o.size_;
    mapping_ = std::move(o.mapping_);
    o.ptr_ = nullptr;
    o.size_ = 0;
    return *this;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return mapping_ ? size_ : own_.capacity(); }
  // Heap bytes held (a mapped view holds none: its pages belong to the file's page cache).
  size_t heap_bytes() const { return own_.capacity() * sizeof(T); }
  bool mapped() const { return mapping_ != nullptr; }

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  T& operator[](size_t i) { return ptr_[i]; }  // a write to a view stays private to this process
  const T& operator[](size_t i) const { return ptr_[i]; }
  const T* begin() const { return ptr_; }
  const T* end() const { return ptr_ + size_; }

  void push_back(const T& x) {
    to_heap();
    own_.push_back(x);
    sync();
  }
  void reserve(size_t n) {
    to_heap();
    own_.reserve(n);
    sync();
  }
  void resize(size_t n) {
    to_heap();
    own_.resize(n);
    sync();
  }
  void assign(size_t n, const T& value) {
    mapping_.reset();
    own_.assign(n, value);
    sync();
  }
  void clear() {
    mapping_.reset();
    own_.clear();
    sync();
  }
  void shrink_to_fit() {
    if (!mapping_) {
      own_.shrink_to_fit();
      sync();
    }
  }
  // Becomes a view of n elements at p, inside a mapping that `mapping` keeps alive.
  void view(T* p, size_t n, std::shared_ptr<void> mapping) {
    own_ = std::vector<T>();
    ptr_ = p;
    size_ = n;
    mapping_ = std::move(mapping);
  }

 private:
  void to_heap() {
    if (!mapping_) return;
    own_.reserve(size_ + size_ / 8 + 1);
    own_.assign(ptr_, ptr_ + size_);
    mapping_.reset();
    sync();
  }
  void sync() {
    ptr_ = own_.data();
    size_ = own_.size();
  }

  std::vector<T> own_;              // the elements while owned
  T* ptr_ = nullptr;                // the elements, owned or viewed
  size_t size_ = 0;                 // their number
  std::shared_ptr<void> mapping_;   // the file mapping a view lives in (null when owned)
};

}  // namespace agentaccel
