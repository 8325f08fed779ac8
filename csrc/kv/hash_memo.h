// HashMemo: remembered chain steps, BLAKE2b input message (le128 parent hash + le32 page tokens) -> its digest,
// so that a prefix lookup over pages looked up before skips BLAKE2b. A direct-mapped table: an entry is only
// ever written with the digest just computed from the message stored beside it, and a hit needs the whole
// message to be byte-equal, so a hit returns exactly what hashing returns. Where an entry sits (its key) only
// decides the hit rate: lookups place page i by a rolling key over the tokens of pages 0..i, which needs no
// hash, so the entries of the next pages can be loaded before the current page is resolved (MemoWalk).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "page_hash.h"

namespace shadowprefill {

class HashMemo {
 public:
  // capacity: entries (rounded up to a power of two); msg_bytes: 16 + 4 * block_size.
  HashMemo(size_t capacity, size_t msg_bytes) : msg_bytes_(msg_bytes) {
    size_t cap = 1;
    while (cap < capacity) cap <<= 1;
    mask_ = cap - 1;
    stride_ = (kHeader + msg_bytes + 63) / 64 * 64;
    // calloc: zero (empty) entries without touching the pages of a large table up front
    raw_.reset(static_cast<uint8_t*>(std::calloc(cap * stride_ + 64, 1)));
    if (!raw_) throw std::bad_alloc();
    base_ = raw_.get() + (64 - reinterpret_cast<uintptr_t>(raw_.get()) % 64) % 64;
  }

  // The rolling key of the page after one with key `key` (the root's key: seed()): tokens are the page's
  // le32 bytes (msg + 16).
  static uint64_t seed(const H128& root) { return root.lo ^ 0x9E3779B97F4A7C15ULL; }
  uint64_t roll(uint64_t key, const uint8_t* tokens) const {
    const size_t n = msg_bytes_ - 16;
    size_t j = 0;
    for (; j + 8 <= n; j += 8) key = mix(key, load(tokens + j));
    if (j < n) key = mix(key, load4(tokens + j));
    return key;
  }

  void prefetch(uint64_t key) const {
    const uint8_t* e = entry(key);
    __builtin_prefetch(e);
    __builtin_prefetch(e + 64);
  }
  // The digest of msg if remembered under key.
  bool find(uint64_t key, const uint8_t* msg, H128& out) const {
    const uint8_t* e = entry(key);
    uint64_t tag;
    std::memcpy(&tag, e, 8);
    if (tag != (key & key_mask_) + 1 || std::memcmp(e + kHeader, msg, msg_bytes_) != 0) return false;
    std::memcpy(&out, e + 8, sizeof(H128));
    return true;
  }
  void put(uint64_t key, const uint8_t* msg, const H128& digest) {
    uint8_t* e = entry(key);
    const uint64_t tag = (key & key_mask_) + 1;  // 0: an empty entry
    std::memcpy(e, &tag, 8);
    std::memcpy(e + 8, &digest, sizeof(H128));
    std::memcpy(e + kHeader, msg, msg_bytes_);
  }
  // Test hook: keep only the low `bits` bits of every key (many different pages then share entries).
  void set_key_bits(int bits) { key_mask_ = bits >= 64 ? ~0ULL : (1ULL << bits) - 1; }

 private:
  static constexpr size_t kHeader = 8 + sizeof(H128);  // tag (key + 1), digest
  static uint64_t load(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint64_t load4(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static uint64_t mix(uint64_t k, uint64_t x) {  // one multiply-xorshift step
    k = (k ^ x) * 0xBF58476D1CE4E5B9ULL;
    return k ^ (k >> 31);
  }
  uint8_t* entry(uint64_t key) const { return base_ + ((key & key_mask_) & mask_) * stride_; }

  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  size_t msg_bytes_, mask_ = 0, stride_ = 0;
  uint64_t key_mask_ = ~0ULL;
  std::unique_ptr<uint8_t, Free> raw_;
  uint8_t* base_ = nullptr;
};

}  // namespace shadowprefill
