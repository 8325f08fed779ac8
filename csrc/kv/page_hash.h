// The page-hash chain in C++ (definition: shadowprefill/kv/page_hash.py):
//   root = BLAKE2b-128("shadowprefill.kv.root\0" + salt),  h_i = BLAKE2b-128(le128(h_{i-1}) + le32 tokens of page i)
// and the reading of Python token lists (ints in [0, 2^32), checked like the Python reference).
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "blake2b.h"

namespace shadowprefill {

struct H128 {  // a 128-bit page hash: the little-endian digest as two words
  uint64_t lo = 0, hi = 0;
  bool operator==(const H128& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const H128& o) const { return !(*this == o); }
};

inline H128 h128_from_digest(const uint8_t d[16]) { return {blake2b_detail::load64(d), blake2b_detail::load64(d + 8)}; }

inline void store_le(uint8_t* p, uint64_t v, int bytes) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  std::memcpy(p, &v, bytes);
#else
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
#endif
}

inline H128 salt_root(const std::string& salt) {
  static const char kPrefix[] = "shadowprefill.kv.root";  // followed by a NUL byte
  std::string msg(kPrefix, sizeof(kPrefix));                // sizeof includes the NUL
  msg += salt;
  uint8_t d[16];
  blake2b(reinterpret_cast<const uint8_t*>(msg.data()), msg.size(), d, 16);
  return h128_from_digest(d);
}

// Errors the Python reference raises for bad tokens (TypeError / ValueError naming token_ids).
struct TokenTypeError : std::runtime_error {
  explicit TokenTypeError(const char* what = "token_ids: expected int token ids") : std::runtime_error(what) {}
};
struct TokenValueError : std::runtime_error {
  TokenValueError() : std::runtime_error("token_ids: token ids must be in [0, 2**32)") {}
};

// A small non-negative int (one CPython digit) read without a call: most token and page ids; false: the
// caller takes the general path (PyLong_AsLongLong).
inline bool small_int(PyObject* item, long long& v) {
  if (!PyLong_CheckExact(item)) return false;
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) return false;
  v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item));
  return v >= 0;
#else
  const Py_ssize_t size = Py_SIZE(item);  // CPython <= 3.11: sign and number of 30-bit digits
  if (size == 0) {
    v = 0;
    return true;
  }
  if (size != 1) return false;
  v = reinterpret_cast<PyLongObject*>(item)->ob_digit[0];
  return true;
#endif
}

// A borrowed view of a Python list or tuple of token ids (the manager passes one of the two).
class Tokens {
 public:
  explicit Tokens(PyObject* seq) : seq_(seq), list_(PyList_Check(seq)) {
    if (!list_ && !PyTuple_Check(seq)) throw TokenTypeError("token_ids: expected a list or tuple of ints");
  }
  Py_ssize_t size() const { return list_ ? PyList_GET_SIZE(seq_) : PyTuple_GET_SIZE(seq_); }
  PyObject* object() const { return seq_; }
  PyObject* item(Py_ssize_t i) const { return list_ ? PyList_GET_ITEM(seq_, i) : PyTuple_GET_ITEM(seq_, i); }
  // Start loading items [i, i + n) (clipped to the list) into the cache: token ints are separate objects,
  // so reading a page is up to 16 cache misses; issued ahead, they overlap the previous page's hashing.
  void prefetch(Py_ssize_t i, Py_ssize_t n) const {
    const Py_ssize_t end = std::min(size(), i + n);
    for (; i < end; ++i) {
      const char* p = reinterpret_cast<const char*>(item(i));
      __builtin_prefetch(p + 8);   // ob_type
      __builtin_prefetch(p + 24);  // the value (a 16-byte aligned object may straddle two lines)
    }
  }
  uint32_t at(Py_ssize_t i) const {
    PyObject* item = this->item(i);
    long long v;
    if (small_int(item, v)) return static_cast<uint32_t>(v);
    v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) {
      bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
      PyErr_Clear();
      if (overflow) throw TokenValueError();
      throw TokenTypeError();
    }
    if (v < 0 || v > 0xFFFFFFFFLL) throw TokenValueError();
    return static_cast<uint32_t>(v);
  }
  // Whether item i equals the int `v` (the O(1) staleness check of a kept chain).
  bool equals(Py_ssize_t i, long long v) const {
    PyObject* item = list_ ? PyList_GET_ITEM(seq_, i) : PyTuple_GET_ITEM(seq_, i);
    long long x = PyLong_AsLongLong(item);
    if (x == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return x == v;
  }

 private:
  PyObject* seq_;
  bool list_;
};

// Hashes pages of one token list one by one, continuing a chain (the one chain step of the C++ side).
class PageHasher {
 public:
  static constexpr int kAhead = 3;  // pages whose tokens are loading ahead of the one hashed
  // Start loading the tokens of pages [page, page + kAhead) (before a run of next() calls from `page`).
  void warm(const Tokens& tokens, int64_t page) const {
    tokens.prefetch(static_cast<Py_ssize_t>(page) * bs_, static_cast<Py_ssize_t>(kAhead) * bs_);
  }
  explicit PageHasher(int block_size) : bs_(block_size), msg_(16 + 4 * static_cast<size_t>(block_size)) {}
  H128 next(H128 parent, const Tokens& tokens, int64_t page) {
    uint8_t* m = msg_.data();
    store_le(m, parent.lo, 8);
    store_le(m + 8, parent.hi, 8);
    const Py_ssize_t start = static_cast<Py_ssize_t>(page) * bs_;
    for (int j = 0; j < bs_; ++j) store_le(m + 16 + 4 * j, tokens.at(start + j), 4);  // le32 tokens
    tokens.prefetch(start + kAhead * bs_, bs_);  // a later page's tokens load while this one is hashed
    uint8_t d[16];
    blake2b(m, msg_.size(), d, 16);
    return h128_from_digest(d);
  }

 private:
  int bs_;
  std::vector<uint8_t> msg_;
};

}  // namespace shadowprefill
