// PageChain (kv_core.h): the kept page hashes of one append-only token list, the C++ twin of
// shadowprefill/kv/page_hash.py PageHashes (extend_to / truncate / retarget behave the same).
#include <algorithm>

#include "kv_core.h"

namespace shadowprefill {

int64_t PageChain::extend_to(int64_t num_pages) {
  Tokens t(tokens.ptr());
  const size_t bs = static_cast<size_t>(block_size);
  size_t known = hashes.size();
  if (known && (static_cast<size_t>(t.size()) < known * bs || !t.equals(static_cast<Py_ssize_t>(known * bs - 1), tail))) {
    // the list no longer holds the known pages (against the append-only contract): keep the common ones
    PageHasher hasher(block_size);
    const size_t n = std::min(known, static_cast<size_t>(num_full(t)));
    size_t i = 0;
    H128 parent = root;
    for (; i < n; ++i) {
      parent = hasher.next(parent, t, static_cast<int64_t>(i));
      if (parent != hashes[i]) break;
    }
    truncate(static_cast<int64_t>(i));
    known = hashes.size();
  }
  const int64_t n = std::min<int64_t>(num_pages, num_full(t));
  if (n > static_cast<int64_t>(known)) {
    PageHasher hasher(block_size);
    for (size_t i = known; i < static_cast<size_t>(n); ++i) at(i, t, hasher);
  }
  return static_cast<int64_t>(hashes.size());
}

void PageChain::truncate(int64_t num_pages) {
  Tokens t(tokens.ptr());
  const int64_t keep = std::max<int64_t>(0, std::min<int64_t>(num_pages, num_full(t)));
  if (keep < static_cast<int64_t>(hashes.size())) hashes.resize(static_cast<size_t>(keep));
  if (keep < static_cast<int64_t>(pages.size())) {
    pages.resize(static_cast<size_t>(keep));
    gens.resize(static_cast<size_t>(keep));
  }
  const size_t n = hashes.size();
  tail = n ? t.at(static_cast<Py_ssize_t>(n) * block_size - 1) : -1;
}

void PageChain::retarget(py::object new_tokens, int64_t keep_pages) {
  Tokens t(new_tokens.ptr());  // a list or tuple
  tokens = std::move(new_tokens);
  truncate(std::min<int64_t>(keep_pages, num_full(t)));
}

}  // namespace shadowprefill
