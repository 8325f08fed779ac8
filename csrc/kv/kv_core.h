// KVCore: the native bookkeeping behind shadowprefill.kv.KVCacheManager(backend="native"): page pool,
// prefix index, host index and the offload state (spills in flight, side-stream copies) of one KV cache.
// It mirrors shadowprefill/kv/core.py method by method (the Python file is the reference and documents
// the rules); a manager call is one call here, token lists and page lists are read in place.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "hash_map.h"
#include "hash_memo.h"
#include "host_index.h"
#include "memo_walk.h"
#include "page_hash.h"
#include "page_pool.h"

namespace py = pybind11;

namespace shadowprefill {

// The kept page hashes of one append-only token list (kv.PageHashes in Python).
struct PageChain {
  PageChain(py::object tokens_, int block_size_, H128 root_) : tokens(std::move(tokens_)), block_size(block_size_), root(root_) {}
  py::object tokens;
  int block_size;
  H128 root;
  std::vector<H128> hashes;
  long long tail = -1;  // the last token of the last known page (-1: none)
  uint64_t owner = 0;             // the KVCore (serial) that resolved `pages`
  std::vector<int32_t> pages;     // pages[i]: canonical device page of hashes[i] when last seen
  std::vector<uint64_t> gens;     // its generation then (still canonical while unchanged)

  int64_t num_full(const Tokens& t) const { return t.size() / block_size; }
  H128 parent_of(size_t i) const { return i ? hashes[i - 1] : root; }
  // Hash of page i, hashing pages up to it (i <= len(hashes)).
  H128 at(size_t i, const Tokens& t, PageHasher& hasher) {
    if (i < hashes.size()) return hashes[i];
    const H128 h = hasher.next(parent_of(i), t, static_cast<int64_t>(i));
    add(h, t);
    return h;
  }
  void add(const H128& h, const Tokens& t) {  // the hash of the next page
    hashes.push_back(h);
    tail = t.at(static_cast<Py_ssize_t>(hashes.size()) * block_size - 1);
  }
  int64_t extend_to(int64_t num_pages);
  void truncate(int64_t num_pages);
  void retarget(py::object new_tokens, int64_t keep_pages);
};

struct Counters {  // the PoolStats counters (stats.py)
  int64_t lookups = 0, lookup_tokens = 0, device_hit_tokens = 0, host_hit_tokens = 0, miss_tokens = 0,
          shadow_hit_tokens = 0, allocated_blocks = 0, allocation_failures = 0, normal_evictions = 0,
          shadow_evictions = 0, spills = 0, spill_bytes = 0, spills_cancelled = 0, reloads = 0, reload_bytes = 0,
          host_drops = 0, shadow_blocks_allocated = 0, shadow_blocks_promoted = 0, shadow_blocks_wasted = 0;
};

class KVCore {
 public:
  KVCore(int32_t num_blocks, int block_size, int64_t shadow_cap, double cold_age_s, std::string model_id,
         py::object host_index, int64_t page_bytes, py::object copy);

  // queries
  py::tuple counts() const;
  py::tuple page(int64_t b) const;
  py::dict stats_dict() const;
  py::dict snapshot() const;
  std::shared_ptr<PageChain> hash_chain(py::object tokens, py::object tenant);
  py::tuple peek(py::object tokens, py::object tenant, int64_t limit, py::object hashes);
  int64_t available(double now, bool shadow, int64_t limit);
  // the request-level sequence
  py::tuple match(py::object tokens, double now, py::object tenant, bool shadow, bool promote, int64_t limit,
                  py::object hashes);
  py::object allocate(int64_t n, double now, bool shadow);
  py::list allocate_up_to(int64_t n, double now, bool shadow);
  int64_t commit(py::object pages, py::object tokens, double now, py::object tenant, py::object num_tokens,
                 py::object hashes);
  void free(py::object pages, double now);
  // One iteration's calls in one: allocate for each count in order, stopping at the first that cannot be
  // met (the page lists of those met); commit for each (pages, tokens, tenant, num_tokens, hashes) item.
  py::list allocate_many(py::object counts, double now, bool shadow);
  int64_t commit_many(py::object items, double now);
  void touch(py::object pages, double now);
  void poll(double now);
  void set_memo_key_bits(int bits) { memo_.set_key_bits(bits); }  // test hook (hash_memo.h)

 private:
  struct Item {       // one page of a match: a device page, or a host entry to reload (page -1)
    int32_t page;
    H128 hash;
    int32_t slot;
    bool take = false;  // a cached device page the match takes a reference on
  };

  void clock(double now);
  H128 root(py::object tenant);
  PageChain* chain_for(py::object tokens, py::object tenant, py::object hashes);
  bool alloc(int64_t n, double now, bool shadow, std::vector<int32_t>& out);
  int64_t available_now(double now, bool shadow, int64_t limit);
  void free_pages(const std::vector<int32_t>& pages, double now);
  bool make_room(int64_t n, bool shadow, double now);
  void evict(const std::vector<int32_t>& victims);
  void give_back(int32_t b, bool lost);
  void retire_spills();
  int32_t cancel_spill(const H128& h);
  void note_side_copy(const std::vector<int32_t>& pages, py::object event, bool newest = true);
  py::object copy_pages(bool to_host, const std::vector<int32_t>& src, const std::vector<int32_t>& dst);
  py::object reload_into(std::vector<Item>& items, double now, bool shadow, bool promote, int64_t& shadow_entries);
  void unallocate(const std::vector<int32_t>& pages);
  bool holds(const H128& h) const { return spill_index_.contains(h) || (host_ && host_->peek(h) >= 0); }
  size_t known_pages(const PageChain* chain, bool kept, size_t num_pages) const;

  int block_size_;
  std::string model_id_;
  int64_t page_bytes_;
  PagePool pool_;
  struct alignas(32) PageInfo {  // prefix-index state of one page (a cache line holds two pages)
    H128 hash;          // its page hash (valid where has_hash)
    uint64_t gen = 0;   // changes whenever the page stops being canonical (evicted, freed)
    uint8_t has_hash = 0;
    uint8_t canon = 0;  // index_ maps hash to this page (a canonical page)
  };
  std::vector<PageInfo> info_;
  HashMap index_;                     // hash -> canonical device page
  py::object host_obj_;               // keeps the shared HostIndex alive
  HostIndex* host_ = nullptr;
  py::object copy_;                   // copy(to_host, src_ids, dst_ids) -> event or None; None: no tensors
  // offload: spills in flight (page -> event, hash), hash -> spilling page, side-stream copies
  PageList spilling_, side_copy_;
  std::vector<py::object> spill_event_, side_event_;
  std::vector<H128> spill_hash_;
  HashMap spill_index_;
  py::object last_event_;
  Counters st_;
  std::unordered_map<std::string, H128> roots_;
  py::object last_tenant_;            // the tenant str of the last root() call and its root
  H128 last_root_;
  std::unique_ptr<PageChain> local_;  // the chain of a call without hashes= (reused)
  // scratch of the hot calls (reused, no allocation per call)
  std::vector<Item> items_;
  std::vector<int32_t> ids_, victims_, unregistered_, slots_, to_host_, to_slots_;
  std::vector<H128> new_hashes_, evict_hashes_, to_hashes_;
  std::vector<int64_t> counts_;
  std::vector<uint8_t> shadows_, copy_flags_;
  std::vector<std::pair<H128, bool>> dropped_;
  double now_;
  PageHasher hasher_;
  HashMemo memo_;                     // lookups: remembered chain steps (exact; a miss hashes)
  MemoWalk walk_;
  uint64_t serial_;
};

}  // namespace shadowprefill
