// KVCore (kv_core.h): the method bodies, in the order of shadowprefill/kv/core.py.
#include "kv_core.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "py_convert.h"

namespace shadowprefill {

// ---- construction, clock, roots, chains --------------------------------------------------------------------
KVCore::KVCore(int32_t num_blocks, int block_size, int64_t shadow_cap, double cold_age_s, std::string model_id,
               py::object host_index, int64_t page_bytes, py::object copy)
    : block_size_(block_size), model_id_(std::move(model_id)), page_bytes_(page_bytes),
      pool_(num_blocks, shadow_cap, cold_age_s), info_(num_blocks),
      host_obj_(host_index), copy_(std::move(copy)), spilling_(num_blocks), side_copy_(num_blocks),
      spill_event_(num_blocks), side_event_(num_blocks), spill_hash_(num_blocks), last_event_(py::none()),
      now_(-std::numeric_limits<double>::infinity()), hasher_(block_size),
      memo_(static_cast<size_t>(num_blocks) + (host_index.is_none() ? 0 : host_index.cast<HostIndex*>()->num_pages),
            16 + 4 * static_cast<size_t>(block_size)),
      walk_(memo_, hasher_, block_size) {
  static std::atomic<uint64_t> serials{1};
  serial_ = serials.fetch_add(1);
  if (!host_index.is_none()) host_ = host_index.cast<HostIndex*>();
}

void KVCore::clock(double now) {
  if (now < now_) {
    throw py::value_error("now: " + py::repr(py::float_(now)).cast<std::string>() + " is earlier than a previous call's " +
                          py::repr(py::float_(now_)).cast<std::string>() + " (time must not decrease)");
  }
  now_ = now;
}

H128 KVCore::root(py::object tenant) {
  if (tenant.ptr() == last_tenant_.ptr()) return last_root_;  // the same str object (held) as last time
  if (!PyUnicode_Check(tenant.ptr()))
    throw py::type_error(std::string("tenant: expected a str, got ") + Py_TYPE(tenant.ptr())->tp_name);
  std::string key = tenant.cast<std::string>();
  auto it = roots_.find(key);
  if (it == roots_.end()) {
    std::string salt = model_id_;
    salt.push_back('\0');
    salt += key;
    it = roots_.emplace(key, salt_root(salt)).first;
  }
  last_tenant_ = tenant;
  last_root_ = it->second;
  return last_root_;
}

std::shared_ptr<PageChain> KVCore::hash_chain(py::object tokens, py::object tenant) {
  Tokens t(tokens.ptr());  // a list or tuple
  return std::make_shared<PageChain>(tokens, block_size_, root(tenant));
}

PageChain* KVCore::chain_for(py::object tokens, py::object tenant, py::object hashes) {
  if (hashes.is_none()) {  // a fresh chain (the reused one, emptied)
    const H128 r = root(tenant);
    if (!local_) return (local_ = std::make_unique<PageChain>(tokens, block_size_, r)).get();
    local_->tokens = std::move(tokens);
    local_->root = r;
    local_->hashes.clear();
    local_->tail = -1;
    local_->owner = 0;
    local_->pages.clear();
    local_->gens.clear();
    return local_.get();
  }
  if (!py::isinstance<PageChain>(hashes))
    throw py::type_error(std::string("hashes: expected the manager's hash_chain(), got ") + Py_TYPE(hashes.ptr())->tp_name);
  PageChain* chain = hashes.cast<PageChain*>();
  if (!chain->tokens.is(tokens) || chain->block_size != block_size_ || chain->root != root(tenant))
    throw py::value_error("hashes: built for another token list, tenant, model or block size "
                          "(use KVCacheManager.hash_chain(token_ids, tenant=...))");
  chain->extend_to(0);  // O(1) check: drops known pages the token list no longer holds
  return chain;
}

// ---- queries -------------------------------------------------------------------------------------------
py::tuple KVCore::counts() const {
  return py::make_tuple(pool_.free.size(), pool_.num_shadow, pool_.num_cached(), spilling_.size());
}

py::tuple KVCore::page(int64_t b) const {
  if (b < 0 || b >= pool_.n) throw py::index_error("block_id: page " + std::to_string(b) + " is out of range");
  py::object h = info_[b].has_hash ? h128_to_int(info_[b].hash) : py::none();
  return py::make_tuple(pool_.ref[b], pool_.shadow[b] != 0, h);
}

py::dict KVCore::stats_dict() const {
  py::dict d;
#define SP_FIELD(name) d[#name] = st_.name
  SP_FIELD(lookups); SP_FIELD(lookup_tokens); SP_FIELD(device_hit_tokens); SP_FIELD(host_hit_tokens);
  SP_FIELD(miss_tokens); SP_FIELD(shadow_hit_tokens); SP_FIELD(allocated_blocks); SP_FIELD(allocation_failures);
  SP_FIELD(normal_evictions); SP_FIELD(shadow_evictions); SP_FIELD(spills); SP_FIELD(spill_bytes);
  SP_FIELD(spills_cancelled); SP_FIELD(reloads); SP_FIELD(reload_bytes); SP_FIELD(host_drops);
  SP_FIELD(shadow_blocks_allocated); SP_FIELD(shadow_blocks_promoted); SP_FIELD(shadow_blocks_wasted);
#undef SP_FIELD
  int64_t spilling_shadow = 0;
  spilling_.for_each([&](int32_t b) { spilling_shadow += pool_.shadow[b]; });
  const int64_t in_use_shadow = pool_.num_shadow - pool_.lru[1].size() - spilling_shadow;
  const int64_t free = static_cast<int64_t>(pool_.free.size());
  d["block_size"] = block_size_;
  d["num_blocks"] = pool_.n;
  d["shadow_cap_blocks"] = pool_.cap;
  d["free_blocks"] = free;
  d["normal_cached_blocks"] = pool_.lru[0].size();
  d["shadow_cached_blocks"] = pool_.lru[1].size();
  d["spilling_blocks"] = spilling_.size();
  d["shadow_in_use_blocks"] = in_use_shadow;
  d["normal_in_use_blocks"] = pool_.n - free - spilling_.size() - pool_.num_cached() - in_use_shadow;
  d["host_capacity_pages"] = host_ ? host_->num_pages : 0;
  d["host_shadow_pages"] = host_ ? host_->num_shadow : 0;
  d["host_normal_pages"] = host_ ? host_->num_used() - host_->num_shadow : 0;
  return d;
}

py::dict KVCore::snapshot() const {
  py::list ref, shadow, hash, free, lru0, lru1, spilling;
  for (int32_t b = 0; b < pool_.n; ++b) {
    ref.append(pool_.ref[b]);
    shadow.append(pool_.shadow[b] != 0);
    hash.append(info_[b].has_hash ? h128_to_int(info_[b].hash) : py::none());
  }
  for (int32_t b : pool_.free) free.append(b);
  pool_.lru[0].for_each([&](int32_t b) { lru0.append(py::make_tuple(b, pool_.last_use[b])); });
  pool_.lru[1].for_each([&](int32_t b) { lru1.append(py::make_tuple(b, pool_.last_use[b])); });
  spilling_.for_each([&](int32_t b) { spilling.append(b); });
  py::dict index;
  index_.for_each([&](const H128& h, int32_t b) { index[h128_to_int(h)] = b; });
  py::dict d;
  d["ref"] = ref; d["shadow"] = shadow; d["hash"] = hash; d["free"] = free;
  py::list lru;
  lru.append(lru0);
  lru.append(lru1);
  d["lru"] = lru; d["spilling"] = spilling; d["index"] = index; d["now"] = now_;
  return d;
}

py::tuple KVCore::peek(py::object tokens, py::object tenant, int64_t limit, py::object hashes) {
  Tokens t(tokens.ptr());
  PageChain* chain = chain_for(tokens, tenant, hashes);
  const size_t num_pages = static_cast<size_t>(limit / block_size_);
  const size_t known = known_pages(chain, !hashes.is_none(), num_pages);
  int64_t device = static_cast<int64_t>(known) * block_size_, host = 0;
  const bool walk = known == 0 && chain->hashes.empty() && num_pages > 0;  // hashed from page 0: the memo
  if (walk) walk_.start(t, chain->root, static_cast<int64_t>(num_pages));
  for (size_t i = known; i < num_pages; ++i) {
    H128 h;
    if (walk) chain->add(h = walk_.next(i ? chain->hashes[i - 1] : chain->root), t);
    else h = chain->at(i, t, hasher_);
    if (index_.contains(h) || spill_index_.contains(h)) device += block_size_;
    else if (host_ && host_->peek(h) >= 0) host += block_size_;
    else break;
  }
  return py::make_tuple(device, host);
}

int64_t KVCore::available(double now, bool shadow, int64_t limit) { return available_now(now, shadow, limit); }

int64_t KVCore::available_now(double now, bool shadow, int64_t limit) {
  clock(now);
  if (!spilling_.empty()) retire_spills();
  return pool_.available(shadow, now, limit, spilling_.size());
}

// ---- the request-level sequence ---------------------------------------------------------------------------
py::tuple KVCore::match(py::object tokens, double now, py::object tenant, bool shadow, bool promote, int64_t limit,
                        py::object hashes) {
  clock(now);
  Tokens t(tokens.ptr());
  PageChain* chain = chain_for(tokens, tenant, hashes);
  const size_t num_pages = static_cast<size_t>(limit / block_size_);
  std::vector<Item>& items = items_;
  items.clear();
  const bool kept = !hashes.is_none();
  const size_t valid = known_pages(chain, kept, num_pages);  // the chain's pages that are still canonical
  items.reserve(num_pages);
  for (size_t i = 0; i < valid; ++i) items.push_back({chain->pages[i], chain->hashes[i], -1, true});
  const size_t known = std::min(chain->hashes.size(), num_pages);
  for (size_t i = valid; i < known; ++i) {  // known hashes: the device run
    const int32_t b = index_.get(chain->hashes[i]);
    if (b < 0) break;
    items.push_back({b, chain->hashes[i], -1, true});
  }
  int64_t num_host = 0;
  size_t i = items.size();
  if (i < num_pages) {  // then device pages, cancelled spills, host hits
    const bool walk = i == 0 && chain->hashes.empty();  // hashed from page 0: through the memo
    H128 h;
    if (walk) {
      walk_.start(t, chain->root, static_cast<int64_t>(num_pages));
      chain->add(h = walk_.next(chain->root), t);
    } else {
      if (i >= chain->hashes.size()) hasher_.warm(t, static_cast<int64_t>(i));
      h = chain->at(i, t, hasher_);
    }
    for (;;) {
      index_.prefetch(h);  // page i's index slot loads while page i + 1 is hashed (kept if the walk gets there)
      if (walk) walk_.ahead(h, [this](const H128& a) { index_.prefetch(a); });  // and those of later pages
      const bool more = i + 1 < num_pages, next_known = i + 1 < chain->hashes.size();
      H128 next;
      if (more)
        next = next_known ? chain->hashes[i + 1] : walk ? walk_.next(h) : hasher_.next(h, t, static_cast<int64_t>(i + 1));
      int32_t b = index_.get(h), slot;
      if (b >= 0) {
        pool_.prefetch(b);
        items.push_back({b, h, -1, true});
      } else if (!spill_index_.empty() && spill_index_.contains(h)) {
        items.push_back({cancel_spill(h), h, -1});
      } else if (host_ && (slot = host_->get(h)) >= 0) {
        items.push_back({-1, h, slot});
        ++num_host;
      } else {
        break;
      }
      if (!more) break;
      if (!next_known) chain->add(next, t);
      h = next;
      ++i;
    }
  }
  // references on the device pages, taken before any reload allocation below (which cannot evict them)
  for (const Item& it : items)
    if (it.take) pool_.acquire(it.page);
  py::object ready = py::none();
  int64_t shadow_pages = 0;
  if (num_host) ready = reload_into(items, now, shadow, promote, shadow_pages);  // reloaded: slot >= 0
  int64_t reloaded = 0;
  for (const Item& it : items) reloaded += it.slot >= 0;
  if (pool_.num_shadow) {
    for (const Item& it : items) {
      if (it.slot < 0 && pool_.shadow[it.page]) {
        ++shadow_pages;
        if (promote) {  // §3.3: a routed request's hit turns the shadow page into a normal one
          pool_.promote(it.page);
          ++st_.shadow_blocks_promoted;
        }
      }
    }
  }
  if (ready.is_none() && !side_copy_.empty()) {  // a copy into / out of a page may still run
    for (const Item& it : items) {
      if (it.slot < 0 && side_copy_.contains(it.page)) {
        ready = last_event_;
        break;
      }
    }
  }
  if (kept) {  // a kept chain remembers where its pages are (all canonical now)
    chain->owner = serial_;
    chain->pages.resize(items.size());
    chain->gens.resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      chain->pages[i] = items[i].page;
      chain->gens[i] = info_[items[i].page].gen;
    }
  }
  const int64_t bs = block_size_, matched = static_cast<int64_t>(items.size()) * bs;
  const int64_t device = (static_cast<int64_t>(items.size()) - reloaded) * bs;
  ++st_.lookups;
  st_.lookup_tokens += limit;
  st_.device_hit_tokens += device;
  st_.host_hit_tokens += matched - device;
  st_.miss_tokens += limit - matched;
  st_.shadow_hit_tokens += shadow_pages * bs;
  py::list pages(items.size());
  for (size_t i = 0; i < items.size(); ++i) PyList_SET_ITEM(pages.ptr(), i, PyLong_FromLong(items[i].page));
  return py::make_tuple(pages, device, matched - device, shadow_pages * bs, ready);
}

bool KVCore::alloc(int64_t n, double now, bool shadow, std::vector<int32_t>& out) {
  clock(now);
  if (n == 0) return true;
  if (!spilling_.empty()) retire_spills();
  if (!pool_.fits(n, shadow) && !make_room(n, shadow, now)) {
    ++st_.allocation_failures;
    return false;
  }
  pool_.take_free(n, shadow, out);
  if (shadow) st_.shadow_blocks_allocated += n;
  st_.allocated_blocks += n;
  return true;
}

py::object KVCore::allocate(int64_t n, double now, bool shadow) {
  std::vector<int32_t> out;
  if (!alloc(n, now, shadow, out)) return py::none();
  return to_list(out);
}

py::list KVCore::allocate_many(py::object counts, double now, bool shadow) {
  py::object seq = fast_sequence(counts, "counts: expected a sequence of ints");
  const Py_ssize_t m = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t>& ns = counts_;
  ns.resize(static_cast<size_t>(m));
  for (Py_ssize_t i = 0; i < m; ++i) {  // validate before taking anything
    long long v;
    if (!small_int(items[i], v)) {
      if (!PyLong_Check(items[i]) || PyBool_Check(items[i])) throw py::type_error("counts: expected ints");
      v = PyLong_AsLongLong(items[i]);
      if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::value_error("counts: a count is out of range");
      }
      if (v < 0) throw py::value_error("counts: expected ints >= 0, got " + std::to_string(v));
    }
    ns[static_cast<size_t>(i)] = v;
  }
  py::list out;
  std::vector<int32_t> pages;
  for (int64_t n : ns) {
    pages.clear();
    if (!alloc(n, now, shadow, pages)) break;
    out.append(to_list(pages));
  }
  return out;
}

int64_t KVCore::commit_many(py::object items, double now) {
  py::object seq =
      fast_sequence(items, "items: expected a sequence of (block_ids, token_ids, tenant, num_tokens, hashes)");
  const Py_ssize_t m = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** its = PySequence_Fast_ITEMS(seq.ptr());
  for (Py_ssize_t i = 0; i < m; ++i) {  // the items' shape first: a malformed one changes nothing
    PyObject* it = its[i];
    if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 5)
      throw py::type_error("items: expected (block_ids, token_ids, tenant, num_tokens, hashes) tuples");
    PyObject* tokens = PyTuple_GET_ITEM(it, 1);
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens))
      throw TokenTypeError("token_ids: expected a list or tuple of ints");
  }
  int64_t registered = 0;
  for (Py_ssize_t i = 0; i < m; ++i) {  // in order, as that many commit calls
    PyObject* it = its[i];
    auto arg = [it](int k) { return py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(it, k)); };
    registered += commit(arg(0), arg(1), now, arg(2), arg(3), arg(4));
  }
  return registered;
}

py::list KVCore::allocate_up_to(int64_t n, double now, bool shadow) {
  std::vector<int32_t> out;
  if (n > 0) alloc(available_now(now, shadow, n), now, shadow, out);
  return to_list(out);
}

int64_t KVCore::commit(py::object pages_obj, py::object tokens, double now, py::object tenant, py::object num_tokens,
                       py::object hashes) {
  clock(now);
  Tokens t(tokens.ptr());
  PageIds pages(pages_obj);
  const int64_t bs = block_size_;
  const int64_t n_tokens = num_tokens.is_none() ? t.size() : std::min<int64_t>(num_tokens.cast<int64_t>(), t.size());
  const int64_t n_full = std::min<int64_t>(pages.size(), n_tokens >= 0 ? n_tokens / bs : -1);
  if (n_full <= 0) return 0;
  // most commits register the last page or few: start loading their ids and the last page's tokens
  for (int64_t i = n_full - 1; i >= 0 && i >= n_full - 8; --i) pages.prefetch(i);
  t.prefetch((n_full - 1) * bs, bs);
  int64_t first = n_full;
  while (first > 0) {  // the pages after the last hashed one
    if (first > 8) pages.prefetch(first - 9);
    const int64_t b = pages.at(first - 1);
    if (b < 0 || b >= pool_.n) throw py::value_error("block_ids: page " + std::to_string(b) + " is out of range");
    if (info_[b].has_hash) break;
    --first;
  }
  if (first >= n_full) return 0;
  if (first < n_full - 1) hasher_.warm(t, first);
  for (int64_t i = first; i < n_full; ++i) {  // validate before changing anything
    const int64_t b = pages.at(i);
    if (b < 0 || b >= pool_.n || pool_.ref[b] <= 0)
      throw py::value_error("block_ids: page " + std::to_string(b) + " is not owned (ref count 0) or out of range");
  }
  const H128 parent = first ? info_[pages.at(first - 1)].hash : root(tenant);
  PageChain* chain = nullptr;
  if (!hashes.is_none()) {
    chain = chain_for(tokens, tenant, hashes);
    if (static_cast<int64_t>(chain->hashes.size()) < first || chain->parent_of(static_cast<size_t>(first)) != parent)
      chain = nullptr;  // the chain does not reach (or disagrees with) the registered pages: not used
  }
  std::vector<H128>& hs = new_hashes_;  // hash all first (their index slots load meanwhile), then register
  hs.clear();
  H128 h = parent;
  for (int64_t i = first; i < n_full; ++i) {
    h = chain ? chain->at(static_cast<size_t>(i), t, hasher_) : hasher_.next(h, t, i);
    index_.prefetch(h);
    hs.push_back(h);
  }
  int64_t registered = 0;
  for (int64_t i = first; i < n_full; ++i) {
    const int32_t b = static_cast<int32_t>(pages.at(i));
    const H128& hi = hs[static_cast<size_t>(i - first)];
    info_[b].hash = hi;
    info_[b].has_hash = 1;
    if (index_.insert(hi, b)) {
      info_[b].canon = 1;
      ++registered;
      if (!spill_index_.empty()) spill_index_.erase(hi);  // an older copy being spilled is no longer canonical
    }
  }
  if (chain && chain->owner != serial_ && first == 0) {  // adopt the chain: it knows no page of this core
    chain->owner = serial_;
    chain->pages.clear();
    chain->gens.clear();
  }
  if (chain && chain->owner == serial_ && static_cast<int64_t>(chain->pages.size()) == first) {
    for (int64_t i = first; i < n_full; ++i) {  // the chain remembers the new canonical pages
      const int32_t b = static_cast<int32_t>(pages.at(i));
      if (!info_[b].canon) break;  // (its hash is chain->hashes[i])
      chain->pages.push_back(b);
      chain->gens.push_back(info_[b].gen);
    }
  }
  return registered;
}

void KVCore::free(py::object pages_obj, double now) {
  clock(now);
  PageIds pages(pages_obj);
  std::vector<int32_t>& ids = ids_;
  ids.resize(static_cast<size_t>(pages.size()));
  for (size_t i = 0; i < ids.size(); ++i) {  // drop one reference each; on a bad page undo and raise
    const int64_t b = pages.at(static_cast<int64_t>(i));
    if (b < 0 || b >= pool_.n || pool_.ref[b] <= 0) {
      for (size_t j = 0; j < i; ++j) ++pool_.ref[ids[j]];
      const char* what = (b < 0 || b >= pool_.n) ? "out of range" : "not owned (ref count 0: double free?)";
      throw py::value_error("block_ids: page " + std::to_string(b) + " is " + what);
    }
    ids[i] = static_cast<int32_t>(b);
    --pool_.ref[b];
  }
  free_pages(ids, now);
}

void KVCore::free_pages(const std::vector<int32_t>& ids, double now) {
  // pages whose references were dropped: the ones at ref 0, last page first, stay cached if canonical
  std::vector<int32_t>& unregistered = unregistered_;
  unregistered.clear();
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    const int32_t b = *it;
    if (pool_.ref[b] != 0) continue;
#ifdef SP_KV_CHECK_CANON
    if (info_[b].canon != (info_[b].has_hash && index_.get(info_[b].hash) == b)) throw std::logic_error("canon out of sync");
#endif
    if (info_[b].canon) pool_.park(b, now);
    else unregistered.push_back(b);
  }
  for (int32_t b : unregistered) give_back(b, true);
}

void KVCore::touch(py::object pages_obj, double now) {
  clock(now);
  PageIds pages(pages_obj);
  for (int64_t i = 0; i < pages.size(); ++i) {
    const int64_t b = pages.at(i);
    if (b < 0 || b >= pool_.n) throw py::value_error("block_ids: page " + std::to_string(b) + " is out of range");
    pool_.touch(static_cast<int32_t>(b), now);
  }
}

void KVCore::poll(double now) {
  clock(now);
  if (!spilling_.empty()) retire_spills();
  while (!side_copy_.empty()) {  // forget side copies that completed
    const int32_t b = side_copy_.front();
    if (!event_done(side_event_[b])) break;
    side_copy_.remove(b);
    side_event_[b] = py::object();
  }
}

// ---- internals ------------------------------------------------------------------------------------------
size_t KVCore::known_pages(const PageChain* chain, bool kept, size_t num_pages) const {
  if (!kept || chain->owner != serial_) return 0;
  const size_t n = std::min(num_pages, chain->pages.size());
  size_t i = 0;
  while (i < n && info_[chain->pages[i]].gen == chain->gens[i]) ++i;
  return i;
}

}  // namespace shadowprefill
