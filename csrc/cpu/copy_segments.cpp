// CPU page copies: merged runs, split across threads when the copy is large.
#include <algorithm>
#include <cstring>
#include <thread>

#include "../segments.h"

namespace shadowprefill {

namespace {
constexpr std::int64_t kParallelBytes = 8 << 20;  // below this one thread is faster
constexpr std::int64_t kMinSliceBytes = 1 << 20;

void copy_range(const std::vector<CopyRun>& runs, std::int64_t begin, std::int64_t end) {
  // Copies bytes [begin, end) of the concatenation of all runs.
  std::int64_t pos = 0;
  for (const CopyRun& r : runs) {
    const std::int64_t lo = std::max(begin, pos), hi = std::min(end, pos + r.bytes);
    if (lo < hi)
      std::memcpy(reinterpret_cast<void*>(r.dst + (lo - pos)), reinterpret_cast<const void*>(r.src + (lo - pos)),
                  static_cast<std::size_t>(hi - lo));
    pos += r.bytes;
    if (pos >= end) break;
  }
}
}  // namespace

void copy_segments_cpu(const SegmentArgs& args, int num_threads) {
  const std::vector<CopyRun> runs = build_runs(args);
  std::int64_t total = 0;
  for (const CopyRun& r : runs) total += r.bytes;
  if (total == 0) return;
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads = static_cast<int>(std::min<std::int64_t>(num_threads, std::max<std::int64_t>(1, total / kMinSliceBytes)));
  if (total < kParallelBytes || num_threads == 1) {
    copy_range(runs, 0, total);
    return;
  }
  std::vector<std::thread> workers;
  const std::int64_t slice = (total + num_threads - 1) / num_threads;
  for (int t = 1; t < num_threads; ++t) {
    const std::int64_t b = t * slice, e = std::min(total, b + slice);
    if (b < e) workers.emplace_back(copy_range, std::cref(runs), b, e);
  }
  copy_range(runs, 0, std::min(total, slice));
  for (auto& w : workers) w.join();
}

}  // namespace shadowprefill
