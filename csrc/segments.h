// Page-aware segment copies shared by the CPU and CUDA paths.
//
// A "segment" is seg_bytes bytes at base + offset + id * stride. Copying a list of pages, or one
// layer range of each page (a contiguous byte range inside a block-major page), is a list of
// segments. Runs of consecutive ids whose segments are back to back in memory on both sides are
// merged into one copy (DESIGN.md §3: consecutive block ids merge into one copy).
#pragma once

#include <algorithm>
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

// The CUDA path's choice per run (by bytes, not by run count): the copy engine (one cudaMemcpyAsync per
// run) reaches full bandwidth once a run amortises the ~2-5 us a call costs, so large runs always go
// there; small runs go to one gather kernel when there are at least `kernel_min_runs` of them and both
// sides are device-addressable. Returns 1 for each run the kernel takes.
inline std::vector<std::uint8_t> kernel_run_mask(const std::vector<CopyRun>& runs, std::int64_t kernel_max_run_bytes,
                                                 std::int64_t kernel_min_runs, bool addressable) {
  std::vector<std::uint8_t> mask(runs.size(), 0);
  if (!addressable) return mask;
  std::int64_t small = 0;
  for (const CopyRun& r : runs) small += r.bytes < kernel_max_run_bytes;
  if (small == 0 || small < kernel_min_runs) return mask;
  for (std::size_t i = 0; i < runs.size(); ++i) mask[i] = runs[i].bytes < kernel_max_run_bytes;
  return mask;
}

// The kernel's work list: the selected runs cut into chunks of at most chunk_bytes (one CTA each), so a
// long run is spread over many CTAs and a short one costs one.
inline std::vector<CopyRun> kernel_chunks(const std::vector<CopyRun>& runs, const std::vector<std::uint8_t>& mask,
                                          std::int64_t chunk_bytes) {
  std::vector<CopyRun> chunks;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!mask[i]) continue;
    for (std::int64_t off = 0; off < runs[i].bytes; off += chunk_bytes)
      chunks.push_back({runs[i].src + static_cast<std::uintptr_t>(off), runs[i].dst + static_cast<std::uintptr_t>(off),
                        std::min(chunk_bytes, runs[i].bytes - off)});
  }
  return chunks;
}

}  // namespace shadowprefill
