// PageList: an ordered set of ids in [0, n) (oldest first) with O(1) push_back, remove and move_to_back,
// linked through per-id prev/next arrays: the C++ counterpart of the OrderedDicts of the Python reference.
#pragma once

#include <cstdint>
#include <vector>

namespace shadowprefill {

class PageList {
 public:
  explicit PageList(int32_t n = 0) : prev_(n, -1), next_(n, -1), in_(n, 0) {}

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool contains(int32_t b) const { return in_[b] != 0; }
  int32_t front() const { return head_; }
  int32_t next(int32_t b) const { return next_[b]; }

  void push_back(int32_t b) {
    prev_[b] = tail_;
    next_[b] = -1;
    if (tail_ >= 0) next_[tail_] = b; else head_ = b;
    tail_ = b;
    in_[b] = 1;
    ++size_;
  }

  void remove(int32_t b) {
    if (prev_[b] >= 0) next_[prev_[b]] = next_[b]; else head_ = next_[b];
    if (next_[b] >= 0) prev_[next_[b]] = prev_[b]; else tail_ = prev_[b];
    in_[b] = 0;
    --size_;
  }

  void move_to_back(int32_t b) {
    if (tail_ == b) return;
    remove(b);
    push_back(b);
  }

  int32_t pop_front() {
    const int32_t b = head_;
    remove(b);
    return b;
  }

  template <class F>
  void for_each(F f) const {
    for (int32_t b = head_; b >= 0; b = next_[b]) f(b);
  }

 private:
  std::vector<int32_t> prev_, next_;
  std::vector<uint8_t> in_;
  int32_t head_ = -1, tail_ = -1;
  int64_t size_ = 0;
};

}  // namespace shadowprefill
