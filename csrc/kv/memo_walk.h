// MemoWalk: the page hashes of one token list from page 0 on, through a HashMemo (hash_memo.h). Each page is
// prepared kAhead pages early (its tokens read into its message, its rolling key computed, its memo entry
// loaded), then resolved once its parent's hash is known: the remembered digest, else BLAKE2b (remembered).
// ahead() resolves the next pages that the memo holds before they are asked for, so that the caller can start
// loading what it will look up with their hashes. The hashes are those of PageHasher::next; so are the
// errors: a page whose tokens the fast read skips (not a small int) is hashed by PageHasher::next, and the
// pages after it without the memo.
#pragma once

#include <cstdint>
#include <vector>

#include "blake2b.h"
#include "hash_memo.h"
#include "page_hash.h"

namespace shadowprefill {

class MemoWalk {
 public:
  static constexpr int kAhead = 8;  // pages prepared ahead of the next one resolved (a power of two)

  MemoWalk(HashMemo& memo, PageHasher& hasher, int block_size)
      : memo_(memo), hasher_(hasher), bs_(block_size), msg_bytes_(16 + 4 * static_cast<size_t>(block_size)),
        ring_(kAhead * msg_bytes_) {}

  // Walk `tokens` (the caller keeps it alive) from page 0, whose parent is `root`, up to page `end` (excl.).
  void start(const Tokens& tokens, const H128& root, int64_t end) {
    tokens_ = &tokens;
    end_ = end;
    page_ = 0;
    resolved_ahead_ = 0;
    keyed_ = true;
    key_ = HashMemo::seed(root);
    for (int64_t p = 0; p < kAhead && p < end; ++p) prepare(p);
  }

  int64_t page() const { return page_; }

  // The hash of page page() (its parent's hash given); moves to the next page.
  H128 next(const H128& parent) {
    const int64_t p = page_++;
    if (resolved_ahead_) {  // resolved by ahead() (from the same parent)
      --resolved_ahead_;
      return resolved_[p % kAhead];
    }
    H128 h;
    if (!(ok_[p % kAhead] && remembered(p, parent, h))) {
      if (ok_[p % kAhead]) {
        uint8_t d[16];
        blake2b(msg_of(p), msg_bytes_, d, 16);
        h = h128_from_digest(d);
        memo_.put(keys_[p % kAhead], msg_of(p), h);
      } else {
        h = hasher_.next(parent, *tokens_, p);
      }
    }
    if (p + kAhead < end_) prepare(p + kAhead);
    return h;
  }

  // Resolve the pages after page() - 1 (hash `parent`) that the memo holds, up to kAhead of them, calling
  // f(hash) for each; next() then returns them.
  template <class F>
  void ahead(const H128& parent, F f) {
    H128 par = resolved_ahead_ ? resolved_[(page_ + resolved_ahead_ - 1) % kAhead] : parent;
    while (resolved_ahead_ < kAhead) {
      const int64_t p = page_ + resolved_ahead_;
      H128 h;
      if (p >= end_ || !ok_[p % kAhead] || !remembered(p, par, h)) break;
      resolved_[p % kAhead] = par = h;
      ++resolved_ahead_;
      f(h);
      if (p + kAhead < end_) prepare(p + kAhead);
    }
  }

 private:
  uint8_t* msg_of(int64_t p) { return ring_.data() + static_cast<size_t>(p % kAhead) * msg_bytes_; }

  bool remembered(int64_t p, const H128& parent, H128& h) {  // page p prepared (ok): its memo entry
    uint8_t* msg = msg_of(p);
    store_le(msg, parent.lo, 8);
    store_le(msg + 8, parent.hi, 8);
    return memo_.find(keys_[p % kAhead], msg, h);
  }

  void prepare(int64_t p) {
    const Py_ssize_t start = static_cast<Py_ssize_t>(p) * bs_;
    tokens_->prefetch(start + kAhead / 2 * static_cast<Py_ssize_t>(bs_), bs_);  // a later page's token objects
    uint8_t* tok = msg_of(p) + 16;
    bool ok = keyed_;
    for (int j = 0; ok && j < bs_; ++j) {
      long long v;
      if (small_int(tokens_->item(start + j), v)) store_le(tok + 4 * j, static_cast<uint64_t>(v), 4);
      else ok = false;
    }
    ok_[p % kAhead] = ok;
    keyed_ = ok;  // the keys of later pages roll over this page's tokens
    if (!ok) return;
    key_ = memo_.roll(key_, tok);
    keys_[p % kAhead] = key_;
    memo_.prefetch(key_);
  }

  HashMemo& memo_;
  PageHasher& hasher_;
  int bs_;
  size_t msg_bytes_;
  std::vector<uint8_t> ring_;  // the messages of the prepared pages (page p at p % kAhead)
  uint64_t keys_[kAhead] = {};
  H128 resolved_[kAhead];       // hashes of pages page_ .. page_ + resolved_ahead_ - 1 (by ahead())
  int resolved_ahead_ = 0;
  bool ok_[kAhead] = {};
  const Tokens* tokens_ = nullptr;
  int64_t end_ = 0, page_ = 0;
  bool keyed_ = true;
  uint64_t key_ = 0;
};

}  // namespace shadowprefill
