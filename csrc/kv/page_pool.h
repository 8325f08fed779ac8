// PagePool: ref counts, normal/shadow classes, per-class LRU with last-use times, the shadow cap and the
// free list of one KV cache, and the eviction rules of paper §3.3. The C++ twin of
// shadowprefill/kv/page_pool.py + eviction.py (same decisions, same order); see those files for the rules.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "page_list.h"

namespace shadowprefill {

class PagePool {
 public:
  PagePool(int32_t num_blocks, int64_t shadow_cap, double cold_age_s)
      : n(num_blocks), cap(shadow_cap), cold_age(cold_age_s), ref(num_blocks, 0), shadow(num_blocks, 0),
        last_use(num_blocks, 0.0), lru{PageList(num_blocks), PageList(num_blocks)} {
    free.reserve(num_blocks);
    for (int32_t b = num_blocks - 1; b >= 0; --b) free.push_back(b);  // stack: pops 0, 1, 2, ... first
  }

  int64_t num_cached() const { return lru[0].size() + lru[1].size(); }
  bool in_lru(int32_t b) const { return lru[0].contains(b) || lru[1].contains(b); }

  // n pages off the free list (n <= free.size()), ref 1, of the class.
  void take_free(int64_t n_take, bool is_shadow, std::vector<int32_t>& out) {
    for (int64_t i = 0; i < n_take; ++i) {
      const int32_t b = free.back();
      free.pop_back();
      ref[b] = 1;
      if (is_shadow) shadow[b] = 1;
      out.push_back(b);
    }
    if (is_shadow) num_shadow += n_take;
  }

  void prefetch(int32_t b) const {
    __builtin_prefetch(&ref[b]);
    lru[0].prefetch(b);
  }

  void acquire(int32_t b) {  // one more reference (a cached page leaves its LRU)
    if (ref[b] == 0) lru[shadow[b]].remove(b);
    ++ref[b];
  }

  void park(int32_t b, double now) {  // ref-0 page becomes the most recently used of its class
    PageList& l = lru[shadow[b]];
    if (!l.contains(b)) l.push_back(b);
    last_use[b] = now;
  }

  void touch(int32_t b, double now) {
    PageList& l = lru[shadow[b]];
    if (l.contains(b)) {
      last_use[b] = now;
      l.move_to_back(b);
    }
  }

  bool promote(int32_t b) {
    if (!shadow[b]) return false;
    shadow[b] = 0;
    --num_shadow;
    return true;
  }

  int64_t give_back(int32_t b) {  // a ref-0 page to the free list; 1 if it was a shadow page
    free.push_back(b);
    if (shadow[b]) {
      shadow[b] = 0;
      --num_shadow;
      return 1;
    }
    return 0;
  }

  bool fits(int64_t n_take, bool is_shadow) const {
    return n_take <= static_cast<int64_t>(free.size()) && !(is_shadow && num_shadow + n_take > cap);
  }

  // Up to `limit` pages of a class's LRU idle since before `idle_before`, least recently used first.
  void cold(int cls, double idle_before, int64_t limit, std::vector<int32_t>& out) const {
    int64_t taken = 0;
    for (int32_t b = lru[cls].front(); b >= 0 && taken < limit; b = lru[cls].next(b), ++taken) {
      if (last_use[b] >= idle_before) break;
      out.push_back(b);
    }
  }

  int64_t count_cold(int cls, double idle_before, int64_t limit) const {
    int64_t c = 0;
    if (limit <= 0) return 0;
    for (int32_t b = lru[cls].front(); b >= 0 && c < limit; b = lru[cls].next(b)) {
      if (last_use[b] >= idle_before) break;
      ++c;
    }
    return c;
  }

  int64_t available(bool is_shadow, double now, int64_t limit, int64_t num_out) const {
    const int64_t nfree = static_cast<int64_t>(free.size());
    if (!is_shadow) return std::min(limit, nfree + num_out + num_cached());
    const double idle_before = now - cold_age;
    const int64_t cold_s = count_cold(1, idle_before, limit), cold_n = count_cold(0, idle_before, limit);
    return std::max<int64_t>(0, std::min(limit, std::min(std::max<int64_t>(cap - num_shadow, 0), nfree + cold_n) + cold_s));
  }

  // The cached pages an allocation of n pages must evict, removed from their LRUs, in eviction order;
  // false (nothing removed) if it cannot be satisfied. Pages being copied out (num_out) count as coming.
  bool evict_for(int64_t n_take, bool is_shadow, double now, int64_t num_out, std::vector<int32_t>& victims) {
    const int64_t nfree = static_cast<int64_t>(free.size());
    if (!is_shadow) {  // shadow entries first, then normal ones, LRU within each class
      const int64_t need = n_take - nfree - num_out;
      if (need <= 0) return true;
      if (need > num_cached()) return false;
      const int64_t from_shadow = std::min(need, lru[1].size());
      for (int64_t i = 0; i < from_shadow; ++i) victims.push_back(lru[1].pop_front());
      for (int64_t i = from_shadow; i < need; ++i) victims.push_back(lru[0].pop_front());
      return true;
    }
    // shadow: only cold entries; when the cap binds, cold shadow entries are recycled first; otherwise
    // free pages first, then cold shadow, then cold normal entries
    const double idle_before = now - cold_age;
    std::vector<int32_t> cold_shadow;
    cold(1, idle_before, n_take, cold_shadow);
    const int64_t must_recycle = std::max<int64_t>(0, n_take - (cap - num_shadow));
    if (must_recycle > static_cast<int64_t>(cold_shadow.size())) return false;
    const size_t start = victims.size();
    victims.insert(victims.end(), cold_shadow.begin(), cold_shadow.begin() + must_recycle);
    int64_t rest = n_take - must_recycle - std::min(n_take - must_recycle, nfree);
    if (rest > 0) {
      const int64_t more = std::min<int64_t>(rest, static_cast<int64_t>(cold_shadow.size()) - must_recycle);
      victims.insert(victims.end(), cold_shadow.begin() + must_recycle, cold_shadow.begin() + must_recycle + more);
      rest -= more;
    }
    if (rest > 0) {
      const size_t before = victims.size();
      cold(0, idle_before, rest, victims);
      if (static_cast<int64_t>(victims.size() - before) < rest) {
        victims.resize(start);
        return false;
      }
    }
    for (size_t i = start; i < victims.size(); ++i) lru[shadow[victims[i]]].remove(victims[i]);
    return true;
  }

  int32_t n;
  int64_t cap;
  double cold_age;
  std::vector<int32_t> ref;
  std::vector<uint8_t> shadow;
  std::vector<double> last_use;
  std::vector<int32_t> free;
  PageList lru[2];  // [normal, shadow]: cached pages, least recently used first
  int64_t num_shadow = 0;
};

}  // namespace shadowprefill
