// Page-aware segment copies shared by the CPU and CUDA paths.
//
// A "segment" is seg_bytes bytes at base + offset + id * stride. Copying a list of pages, or one
// layer range of each page (a contiguous byte range inside a block-major page), is a list of
// segments. Runs of consecutive ids whose segments are back to back in memory on both sides are
// merged into one copy (DESIGN.md §3: consecutive block ids merge into one copy).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace shadowprefill {

struct CopyRun {
  std::uintptr_t src;
  std::uintptr_t dst;
  std::int64_t bytes;
};

struct SegmentArgs {
  std::uintptr_t src_ptr;
  std::uintptr_t dst_ptr;
  std::uintptr_t src_ids_ptr;  // int64 ids on the host, 0 = identity
  std::uintptr_t dst_ids_ptr;  // int64 ids on the host, 0 = identity
  std::int64_t n;
  std::int64_t src_stride;
  std::int64_t dst_stride;
  std::int64_t src_offset;
  std::int64_t dst_offset;
  std::int64_t seg_bytes;
  std::int64_t src_count;  // ids must lie in [0, src_count) when >= 0
  std::int64_t dst_count;  // ids must lie in [0, dst_count) when >= 0
};

inline void check_args(const SegmentArgs& a) {
  if (a.n < 0) throw std::invalid_argument("n must be >= 0, got " + std::to_string(a.n));
  if (a.seg_bytes < 0) throw std::invalid_argument("seg_bytes must be >= 0");
  if (a.src_stride < 0 || a.dst_stride < 0) throw std::invalid_argument("strides must be >= 0");
  if (a.src_offset < 0 || a.dst_offset < 0) throw std::invalid_argument("offsets must be >= 0");
  if (a.n > 0 && a.seg_bytes > 0 && (a.src_ptr == 0 || a.dst_ptr == 0))
    throw std::invalid_argument("src_ptr and dst_ptr must be non-null");
}

// Builds the merged run list; validates ids against src_count / dst_count when given.
inline std::vector<CopyRun> build_runs(const SegmentArgs& a) {
  check_args(a);
  std::vector<CopyRun> runs;
  if (a.n == 0 || a.seg_bytes == 0) return runs;
  const auto* src_ids = reinterpret_cast<const std::int64_t*>(a.src_ids_ptr);
  const auto* dst_ids = reinterpret_cast<const std::int64_t*>(a.dst_ids_ptr);
  const bool src_packed = a.src_stride == a.seg_bytes;
  const bool dst_packed = a.dst_stride == a.seg_bytes;
  std::int64_t prev_s = -2, prev_d = -2;
  runs.reserve(static_cast<std::size_t>(a.n));
  for (std::int64_t i = 0; i < a.n; ++i) {
    const std::int64_t s = src_ids ? src_ids[i] : i;
    const std::int64_t d = dst_ids ? dst_ids[i] : i;
    if (s < 0 || (a.src_count >= 0 && s >= a.src_count))
      throw std::out_of_range("src id " + std::to_string(s) + " at index " + std::to_string(i) +
                              " out of range [0, " + std::to_string(a.src_count) + ")");
    if (d < 0 || (a.dst_count >= 0 && d >= a.dst_count))
      throw std::out_of_range("dst id " + std::to_string(d) + " at index " + std::to_string(i) +
                              " out of range [0, " + std::to_string(a.dst_count) + ")");
    const bool extends = !runs.empty() && src_packed && dst_packed && s == prev_s + 1 && d == prev_d + 1;
    if (extends) {
      runs.back().bytes += a.seg_bytes;
    } else {
      runs.push_back({a.src_ptr + static_cast<std::uintptr_t>(a.src_offset + s * a.src_stride),
                      a.dst_ptr + static_cast<std::uintptr_t>(a.dst_offset + d * a.dst_stride), a.seg_bytes});
    }
    prev_s = s;
    prev_d = d;
  }
  return runs;
}

}  // namespace shadowprefill
