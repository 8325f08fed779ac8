// PageList: an ordered set of ids in [0, n) (oldest first) with O(1) push_back, remove and move_to_back,
// linked through one per-id node {prev, next} (one cache line per id touched): the C++ counterpart of the
// OrderedDicts of the Python reference.
#pragma once

#include <cstdint>
#include <vector>

namespace shadowprefill {

class PageList {
 public:
  explicit PageList(int32_t n = 0) : node_(n, Node{kOut, kOut}) {}

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool contains(int32_t b) const { return node_[b].prev != kOut; }
  int32_t front() const { return head_; }
  int32_t next(int32_t b) const { return node_[b].next; }
  void prefetch(int32_t b) const { __builtin_prefetch(&node_[b]); }

  void push_back(int32_t b) {
    node_[b] = Node{tail_, -1};
    if (tail_ >= 0) node_[tail_].next = b; else head_ = b;
    tail_ = b;
    ++size_;
  }

  void remove(int32_t b) {
    const Node n = node_[b];
    if (n.prev >= 0) node_[n.prev].next = n.next; else head_ = n.next;
    if (n.next >= 0) node_[n.next].prev = n.prev; else tail_ = n.prev;
    node_[b] = Node{kOut, kOut};
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
    for (int32_t b = head_; b >= 0; b = node_[b].next) f(b);
  }

 private:
  static constexpr int32_t kOut = -2;  // prev of an id not in the list (the head's prev is -1)
  struct Node {
    int32_t prev, next;
  };
  std::vector<Node> node_;
  int32_t head_ = -1, tail_ = -1;
  int64_t size_ = 0;
};

}  // namespace shadowprefill
