// KVCore (kv_core.h), its eviction and host-tier side: making room (evicting cached pages into the host
// index, spilling them), freeing pages, retiring and cancelling spills, side-stream copies and reloads. The
// order of every step follows shadowprefill/kv/core.py (_make_room, _evict, _reload_into) and offload.py.
#include "kv_core.h"

#include "py_convert.h"

namespace shadowprefill {

bool KVCore::make_room(int64_t n, bool shadow, double now) {
  const int64_t spilling = spilling_.size();
  if (spilling && n <= static_cast<int64_t>(pool_.free.size()) + spilling) return false;  // wait for the spills
  std::vector<int32_t>& victims = victims_;
  victims.clear();
  if (!pool_.evict_for(n, shadow, now, spilling, victims)) return false;
  evict(victims);
  return pool_.fits(n, shadow);
}

void KVCore::evict(const std::vector<int32_t>& victims) {
  // three passes, so that the cache misses of one pass overlap: the victims' hashes, their index slots
  // (and host-index slots), then the erasures
  for (int32_t b : victims) __builtin_prefetch(&info_[b].hash);
  std::vector<H128>& hashes = evict_hashes_;
  hashes.clear();
  for (int32_t b : victims) {
    hashes.push_back(info_[b].hash);
    index_.prefetch(info_[b].hash);
    if (host_) host_->prefetch(info_[b].hash);
  }
  for (size_t i = 0; i < victims.size(); ++i) {
    const int32_t b = victims[i];
    index_.erase(hashes[i]);
    info_[b].canon = 0;
    ++info_[b].gen;
  }
  std::vector<uint8_t>& shadows = shadows_;
  shadows.clear();
  int64_t n_shadow = 0;
  if (pool_.num_shadow) {
    for (int32_t b : victims) shadows.push_back(pool_.shadow[b]);
    for (uint8_t s : shadows) n_shadow += s;
  }
  st_.shadow_evictions += n_shadow;
  st_.normal_evictions += static_cast<int64_t>(victims.size()) - n_shadow;
  if (host_ == nullptr || host_->num_pages == 0) {
    for (int32_t b : victims) give_back(b, true);
    return;
  }
  std::vector<int32_t>& slots = slots_;
  std::vector<uint8_t>& copy = copy_flags_;
  std::vector<std::pair<H128, bool>>& dropped = dropped_;
  dropped.clear();
  host_->put_many(hashes, pool_.num_shadow || !shadows.empty() ? &shadows : nullptr, slots, copy, dropped);
  if (!dropped.empty()) {  // host full: its LRU entries were dropped (content lost unless held elsewhere)
    st_.host_drops += static_cast<int64_t>(dropped.size());
    for (const auto& d : dropped)
      if (d.second && index_.get(d.first) < 0 && !holds(d.first)) ++st_.shadow_blocks_wasted;
  }
  std::vector<int32_t>& to_host = to_host_;
  std::vector<int32_t>& to_slots = to_slots_;
  std::vector<H128>& to_hashes = to_hashes_;
  to_host.clear();
  to_slots.clear();
  to_hashes.clear();
  for (size_t i = 0; i < victims.size(); ++i) {
    const int32_t b = victims[i];
    if (copy[i]) {
      to_host.push_back(b);
      to_slots.push_back(slots[i]);
      to_hashes.push_back(hashes[i]);
      continue;
    }
    // held by the host already, or stored and dropped again: free now unless a side copy still reads it
    if (!side_copy_.empty() && side_copy_.contains(b)) {
      py::object event = side_event_[b];
      side_copy_.remove(b);
      side_event_[b] = py::object();
      if (!event_done(event)) {  // parked: reusable after that copy (not indexed: the host serves hits)
        if (!spilling_.contains(b)) spilling_.push_back(b);
        spill_event_[b] = event;
        spill_hash_[b] = info_[b].hash;
        continue;
      }
    }
    give_back(b, false);
  }
  if (to_host.empty()) return;
  st_.spills += static_cast<int64_t>(to_host.size());
  st_.spill_bytes += static_cast<int64_t>(to_host.size()) * page_bytes_;
  py::object event = copy_pages(true, to_host, to_slots);
  if (event.is_none()) {  // synchronous (CPU) or bookkeeping-only: free now
    for (int32_t b : to_host) give_back(b, false);
    return;
  }
  last_event_ = event;
  for (size_t i = 0; i < to_host.size(); ++i) {  // handed out again only after the copy completed (poll)
    const int32_t b = to_host[i];
    if (!spilling_.contains(b)) spilling_.push_back(b);
    spill_event_[b] = event;
    spill_hash_[b] = to_hashes[i];
    spill_index_.set(to_hashes[i], b);
  }
}

void KVCore::give_back(int32_t b, bool lost) {
  info_[b].has_hash = 0;
  info_[b].canon = 0;
  ++info_[b].gen;
  const int64_t was_shadow = pool_.give_back(b);
  if (lost) st_.shadow_blocks_wasted += was_shadow;  // shadow content gone without a routed hit
}

void KVCore::retire_spills() {
  std::vector<std::pair<int32_t, H128>> done;
  while (!spilling_.empty()) {  // one side stream: copies complete in order
    const int32_t b = spilling_.front();
    if (!event_done(spill_event_[b])) break;
    spilling_.remove(b);
    spill_event_[b] = py::object();
    const H128 h = spill_hash_[b];
    if (spill_index_.get(h) == b) spill_index_.erase(h);
    done.emplace_back(b, h);
  }
  for (const auto& d : done) give_back(d.first, host_->peek(d.second) < 0);
}

int32_t KVCore::cancel_spill(const H128& h) {
  const int32_t b = spill_index_.erase(h);
  py::object event = spill_event_[b];
  spilling_.remove(b);
  spill_event_[b] = py::object();
  note_side_copy({b}, event, false);  // the device->host copy may still read it (an older event)
  const int32_t old = index_.set(h, b);
  if (old >= 0 && old != b) info_[old].canon = 0;
  info_[b].canon = 1;
  pool_.ref[b] = 1;
  ++st_.spills_cancelled;
  return b;
}

void KVCore::note_side_copy(const std::vector<int32_t>& pages, py::object event, bool newest) {
  for (int32_t b : pages) {
    if (side_copy_.contains(b)) side_copy_.move_to_back(b); else side_copy_.push_back(b);
    side_event_[b] = event;
  }
  if (newest) last_event_ = event;  // the newest copy on the side stream: waiting on it covers every older one
}

py::object KVCore::copy_pages(bool to_host, const std::vector<int32_t>& src, const std::vector<int32_t>& dst) {
  if (copy_.is_none()) return py::none();
  return copy_(to_host, to_list(src), to_list(dst));
}

void KVCore::unallocate(const std::vector<int32_t>& pages) {
  for (int32_t b : pages) {
    pool_.ref[b] = 0;
    st_.shadow_blocks_allocated -= pool_.shadow[b];
  }
  st_.allocated_blocks -= static_cast<int64_t>(pages.size());
  for (int32_t b : pages) give_back(b, false);
}

py::object KVCore::reload_into(std::vector<Item>& items, double now, bool shadow, bool promote, int64_t& shadow_entries) {
  int64_t wanted = 0;
  for (const Item& it : items) wanted += it.page < 0;
  std::vector<int32_t> fresh;
  if (wanted > 0) alloc(available_now(now, shadow, wanted), now, shadow, fresh);
  size_t cut = items.size(), used = 0;
  for (size_t pos = 0; pos < items.size(); ++pos) {  // the allocation may have spilled pages and dropped entries
    const Item& it = items[pos];
    if (it.page < 0) {
      if (used == fresh.size() || host_->peek(it.hash) != it.slot) {
        cut = pos;
        break;
      }
      ++used;
    }
  }
  if (used < fresh.size()) {
    unallocate(std::vector<int32_t>(fresh.begin() + used, fresh.end()));
    fresh.resize(used);
  }
  std::vector<int32_t> tail;
  for (size_t pos = cut; pos < items.size(); ++pos)
    if (items[pos].page >= 0) tail.push_back(items[pos].page);
  items.resize(cut);
  if (!tail.empty()) {  // release the device pages after the cut (they were acquired above)
    clock(now);
    for (int32_t b : tail) --pool_.ref[b];
    free_pages(tail, now);
  }
  std::vector<int32_t> slots, dsts;
  size_t next = 0;
  for (Item& it : items) {
    if (it.page >= 0) {
      it.slot = -1;
      continue;
    }
    const int32_t b = fresh[next++];
    it.page = b;
    info_[b].hash = it.hash;
    info_[b].has_hash = 1;
    info_[b].canon = index_.insert(it.hash, b);
    if (host_->is_shadow(it.slot)) {
      ++shadow_entries;
      if (promote) {  // §3.3: a routed hit makes the content normal
        host_->set_class(it.slot, false);
        ++st_.shadow_blocks_promoted;
      }
    }
    slots.push_back(it.slot);
    dsts.push_back(b);
  }
  st_.reloads += static_cast<int64_t>(dsts.size());
  st_.reload_bytes += static_cast<int64_t>(dsts.size()) * page_bytes_;
  py::object event = copy_pages(false, slots, dsts);
  if (!event.is_none()) note_side_copy(dsts, event);
  return event;
}

}  // namespace shadowprefill
