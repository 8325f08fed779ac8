// HostIndex: the entries of a HostTier (page hash -> slot, LRU, a class per slot). The C++ twin of
// shadowprefill/kv/host_index.py: same slots, same drops, same order.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "hash_map.h"
#include "page_list.h"

namespace shadowprefill {

class HostIndex {
 public:
  explicit HostIndex(int64_t num_pages)
      : num_pages(num_pages), lru_(static_cast<int32_t>(num_pages)), slot_(num_pages) {
    for (int64_t s = num_pages - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
  }

  int64_t num_used() const { return lru_.size(); }
  int32_t peek(const H128& h) const { return map_.get(h); }
  void prefetch(const H128& h) const { map_.prefetch(h); }
  int32_t get(const H128& h) {
    const int32_t slot = map_.get(h);
    if (slot >= 0) lru_.move_to_back(slot);
    return slot;
  }
  bool is_shadow(int32_t slot) const { return slot_[slot].shadow != 0; }
  void set_class(int32_t slot, bool shadow) {
    if (is_shadow(slot) != shadow) {
      slot_[slot].shadow = shadow;
      num_shadow += shadow ? 1 : -1;
    }
  }

  // Admit evicted pages in eviction order (see host_index.py put_many). slots[i] = -1 without pages;
  // copy[i]: stored by this call and still held at its end; dropped: (hash, was shadow) in drop order.
  void put_many(const std::vector<H128>& hashes, const std::vector<uint8_t>* shadows, std::vector<int32_t>& slots,
                std::vector<uint8_t>& copy, std::vector<std::pair<H128, bool>>& dropped) {
    const size_t n = hashes.size();
    slots.assign(n, -1);
    copy.assign(n, 0);
    if (num_pages == 0) return;
    ++call_;
    if (free_.empty()) {  // the entries that may be dropped: load their slots, then their map slots
      int32_t s = lru_.front();
      for (size_t i = 0; i < n && s >= 0; ++i, s = lru_.next(s)) __builtin_prefetch(&slot_[s]);
      s = lru_.front();
      for (size_t i = 0; i < n && s >= 0; ++i, s = lru_.next(s)) map_.prefetch(slot_[s].hash);
    }
    for (size_t i = 0; i < n; ++i) {
      const H128& h = hashes[i];
      const bool shadow = shadows != nullptr && (*shadows)[i];
      int32_t slot = map_.get(h);
      if (slot >= 0) {
        lru_.move_to_back(slot);
      } else {
        if (!free_.empty()) {
          slot = free_.back();
          free_.pop_back();
        } else {  // drop the least recently used entry (possibly one stored earlier in this call)
          slot = lru_.pop_front();
          const Slot& old = slot_[slot];
          map_.erase(old.hash);
          dropped.emplace_back(old.hash, old.shadow != 0);
          if (old.stored_call == call_) copy[old.stored_at] = 0;
        }
        lru_.push_back(slot);
        map_.set(h, slot);
        Slot& e = slot_[slot];
        e.hash = h;
        copy[i] = 1;
        e.stored_call = call_;
        e.stored_at = static_cast<int32_t>(i);
      }
      set_class(slot, shadow);
      slots[i] = slot;
    }
  }

  template <class F>
  void for_each(F f) const {  // (hash, slot), least recently used first
    lru_.for_each([&](int32_t slot) { f(slot_[slot].hash, slot); });
  }

  const int64_t num_pages;
  int64_t num_shadow = 0;

 private:
  struct alignas(32) Slot {  // one host slot's entry (a cache line holds two)
    H128 hash;
    uint64_t stored_call = 0;  // which put_many call stored the slot's page (drops within one call)
    int32_t stored_at = -1;
    uint8_t shadow = 0;
  };
  PageList lru_;                      // slots in use, least recently used first
  HashMap map_;                       // hash -> slot
  std::vector<Slot> slot_;
  std::vector<int32_t> free_;
  uint64_t call_ = 0;
};

}  // namespace shadowprefill
