// BLAKE2b (RFC 7693), unkeyed, 1..64-byte digests: the hash of shadowprefill's page-hash chain
// (shadowprefill/kv/page_hash.py gives the chain's definition; Python computes it with hashlib).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shadowprefill {
namespace blake2b_detail {

constexpr uint64_t kIV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                             0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                             0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

// Message word schedule of the 12 rounds (rounds 10 and 11 repeat 0 and 1).
constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline uint64_t load64(const uint8_t* p) {  // little-endian on every host
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
#else
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#endif
}

// The mixing function G on words a, b, c, d of the work vector with message words x, y.
#define SP_B2B_G(a, b, c, d, x, y) \
  do {                             \
    a = a + b + (x);               \
    d = rotr(d ^ a, 32);           \
    c = c + d;                     \
    b = rotr(b ^ c, 24);           \
    a = a + b + (y);               \
    d = rotr(d ^ a, 16);           \
    c = c + d;                     \
    b = rotr(b ^ c, 63);           \
  } while (0)

// One round r: the columns, then the diagonals. r is a literal, so every message index is a constant and
// the 16 message words and the work vector stay in registers.
#define SP_B2B_ROUND(r)                                                            \
  do {                                                                             \
    SP_B2B_G(v0, v4, v8, v12, m[kSigma[r][0]], m[kSigma[r][1]]);                   \
    SP_B2B_G(v1, v5, v9, v13, m[kSigma[r][2]], m[kSigma[r][3]]);                   \
    SP_B2B_G(v2, v6, v10, v14, m[kSigma[r][4]], m[kSigma[r][5]]);                  \
    SP_B2B_G(v3, v7, v11, v15, m[kSigma[r][6]], m[kSigma[r][7]]);                  \
    SP_B2B_G(v0, v5, v10, v15, m[kSigma[r][8]], m[kSigma[r][9]]);                  \
    SP_B2B_G(v1, v6, v11, v12, m[kSigma[r][10]], m[kSigma[r][11]]);                \
    SP_B2B_G(v2, v7, v8, v13, m[kSigma[r][12]], m[kSigma[r][13]]);                 \
    SP_B2B_G(v3, v4, v9, v14, m[kSigma[r][14]], m[kSigma[r][15]]);                 \
  } while (0)

// Compression F of one 128-byte block; t = bytes hashed so far including this block.
inline void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, bool last) {
  uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3], v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
  uint64_t v8 = kIV[0], v9 = kIV[1], v10 = kIV[2], v11 = kIV[3];
  uint64_t v12 = kIV[4] ^ t;  // low word of the 128-bit counter (messages here are far below 2^64 bytes)
  uint64_t v13 = kIV[5], v14 = last ? ~kIV[6] : kIV[6], v15 = kIV[7];
  SP_B2B_ROUND(0); SP_B2B_ROUND(1); SP_B2B_ROUND(2); SP_B2B_ROUND(3); SP_B2B_ROUND(4); SP_B2B_ROUND(5);
  SP_B2B_ROUND(6); SP_B2B_ROUND(7); SP_B2B_ROUND(8); SP_B2B_ROUND(9); SP_B2B_ROUND(10); SP_B2B_ROUND(11);
  h[0] ^= v0 ^ v8; h[1] ^= v1 ^ v9; h[2] ^= v2 ^ v10; h[3] ^= v3 ^ v11;
  h[4] ^= v4 ^ v12; h[5] ^= v5 ^ v13; h[6] ^= v6 ^ v14; h[7] ^= v7 ^ v15;
}
#undef SP_B2B_ROUND
#undef SP_B2B_G

}  // namespace blake2b_detail

// BLAKE2b of `len` bytes with an `outlen`-byte digest (no key), written to `out`.
inline void blake2b(const uint8_t* data, size_t len, uint8_t* out, size_t outlen) {
  using namespace blake2b_detail;
  uint64_t h[8];
  for (int i = 0; i < 8; ++i) h[i] = kIV[i];
  h[0] ^= 0x01010000ULL ^ static_cast<uint64_t>(outlen);  // parameter block: depth 1, fanout 1, no key
  size_t done = 0;
  while (len - done > 128) {  // every block but the last
    done += 128;
    compress(h, data + done - 128, done, false);
  }
  uint8_t last[128] = {0};
  std::memcpy(last, data + done, len - done);
  compress(h, last, len, true);
  for (size_t i = 0; i < outlen; ++i) out[i] = static_cast<uint8_t>(h[i / 8] >> (8 * (i % 8)));
}

}  // namespace shadowprefill
