// HashMap: page hash (H128) -> int32 (a page or a slot), open addressing with linear probing and
// backward-shift deletion (no tombstones); grows at half load. Page hashes are BLAKE2b output, so the low
// word is a good bucket index as is.
#pragma once

#include <cstdint>
#include <vector>

#include "page_hash.h"

namespace shadowprefill {

class HashMap {
 public:
  HashMap() { rehash(16); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  int32_t get(const H128& k) const {  // -1 if absent
    for (size_t i = k.lo & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value < 0) return -1;
      if (s.key == k) return s.value;
    }
  }

  bool contains(const H128& k) const { return get(k) >= 0; }

  // Start loading k's home slot (a lookup soon after then hits the cache).
  void prefetch(const H128& k) const { __builtin_prefetch(&slots_[k.lo & mask_]); }

  int32_t set(const H128& k, int32_t v) {  // insert or overwrite (v >= 0); the old value, -1 if none
    bool inserted;
    Slot& s = place(k, inserted);
    const int32_t old = inserted ? -1 : s.value;
    s.value = v;
    return old;
  }

  // Insert k -> v unless k is present; returns whether it inserted (one probe).
  bool insert(const H128& k, int32_t v) {
    bool inserted;
    Slot& s = place(k, inserted);
    if (inserted) s.value = v;
    return inserted;
  }

  int32_t erase(const H128& k) {  // the removed value, -1 if absent
    size_t i = k.lo & mask_;
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].value < 0) return -1;
      if (slots_[i].key == k) break;
    }
    const int32_t old = slots_[i].value;
    // backward shift: move later entries of the probe run into the hole when their home allows it
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].value >= 0; j = (j + 1) & mask_) {
      const size_t home = slots_[j].key.lo & mask_;
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].value = -1;
    --size_;
    return old;
  }

  template <class F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.value >= 0) f(s.key, s.value);
  }

 private:
  struct Slot {
    H128 key;
    int32_t value = -1;
  };

  // The slot of k: its entry if present, else the empty slot that ends its probe run, claimed for k
  // (`inserted`; the caller stores the value). Grows first so that the table stays at most half full.
  Slot& place(const H128& k, bool& inserted) {
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * slots_.size());
    for (size_t i = k.lo & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.value < 0) {
        s.key = k;
        ++size_;
        inserted = true;
        return s;
      }
      if (s.key == k) {
        inserted = false;
        return s;
      }
    }
  }

  void rehash(size_t capacity) {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.value >= 0) set(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
};

}  // namespace shadowprefill
