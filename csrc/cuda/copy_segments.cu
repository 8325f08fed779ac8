// CUDA page copies between device pages, pinned host memory and contiguous device buffers.
//
// The path is chosen per merged run by its size (segments.h, kernel_run_mask): large runs are one
// cudaMemcpyAsync each (the copy engines reach full PCIe / HBM bandwidth without taking SMs); when there
// are many small runs and both sides are device-addressable (device memory, or pinned host memory mapped
// into the device address space), those go to one gather kernel over a chunk table. The table is staged
// in pinned host memory (a ring reused once the event after its upload completed), so the upload is a
// true async copy: no pageable staging. Everything is enqueued on the caller's stream; the host never
// waits, except when more than the ring's capacity of tables is still in flight.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "../segments.h"

namespace shadowprefill {

namespace {
constexpr int kThreads = 256;
constexpr std::int64_t kChunkBytes = 64 << 10;  // one CTA moves at most this much
constexpr std::size_t kRingBytes = 1 << 20;     // pinned staging for run tables (43,690 chunks)

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Device address of a pointer, or 0 when the device cannot address it (pageable host memory).
std::uintptr_t device_address(std::uintptr_t ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unregistered pointer
    return 0;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)
    return reinterpret_cast<std::uintptr_t>(attr.devicePointer);
  if (attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr)
    return reinterpret_cast<std::uintptr_t>(attr.devicePointer);
  return 0;
}

// Pinned host staging for the chunk tables of one device: a ring of byte ranges, each released once the
// event recorded after its upload has completed.
class PinnedRing {
 public:
  // Enqueues an upload of `bytes` host bytes at `data` to `device_dst` on `stream` through pinned staging
  // (a true async copy). The staging range is reused once the event recorded after the copy completed;
  // staging, copy and record happen under the lock, so no other thread sees the range before its event.
  void upload(const void* data, std::size_t bytes, void* device_dst, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t size = (bytes + 255) & ~static_cast<std::size_t>(255);
    if (size > capacity_) grow(size);
    std::size_t start = 0;
    reclaim(false);
    while (!place(size, start)) reclaim(true);  // full of uploads in flight: wait for the oldest
    cudaEvent_t event = take_event();
    std::memcpy(base_ + start, data, bytes);
    check(cudaMemcpyAsync(device_dst, base_ + start, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(table)");
    check(cudaEventRecord(event, stream), "cudaEventRecord");
    in_flight_.push_back({start, size, event});
    head_ = start + size;
  }

 private:
  struct Slot {
    std::size_t offset, bytes;
    cudaEvent_t event;
  };

  // Slots are handed out in address order with wrap-around: used space is [tail, head) or, wrapped,
  // [tail, capacity) + [0, head).
  bool place(std::size_t bytes, std::size_t& start) const {
    if (in_flight_.empty()) {
      start = 0;
      return true;
    }
    const std::size_t tail = in_flight_.front().offset;
    if (head_ > tail) {
      if (head_ + bytes <= capacity_) {
        start = head_;
        return true;
      }
      start = 0;
      return bytes <= tail;
    }
    start = head_;
    return head_ + bytes <= tail;
  }

  void grow(std::size_t bytes) {
    for (auto& s : in_flight_) check(cudaEventSynchronize(s.event), "cudaEventSynchronize");
    reclaim(false);
    if (base_) check(cudaFreeHost(base_), "cudaFreeHost");
    capacity_ = std::max(kRingBytes, 2 * bytes);
    check(cudaHostAlloc(reinterpret_cast<void**>(&base_), capacity_, cudaHostAllocPortable), "cudaHostAlloc");
    head_ = 0;
  }

  // Frees finished slots from the front; with `wait`, waits for the oldest first.
  void reclaim(bool wait) {
    if (wait && !in_flight_.empty()) check(cudaEventSynchronize(in_flight_.front().event), "cudaEventSynchronize");
    while (!in_flight_.empty()) {
      const cudaError_t status = cudaEventQuery(in_flight_.front().event);
      if (status == cudaErrorNotReady) break;
      check(status, "cudaEventQuery");
      free_events_.push_back(in_flight_.front().event);
      in_flight_.pop_front();
    }
  }

  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }

  std::mutex mutex_;
  char* base_ = nullptr;
  std::size_t capacity_ = 0, head_ = 0;
  std::deque<Slot> in_flight_;
  std::vector<cudaEvent_t> free_events_;
};

PinnedRing& ring_of_current_device() {
  static std::mutex mutex;
  static std::map<int, PinnedRing*> rings;  // never freed: lives as long as the process
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  auto& ring = rings[device];
  if (!ring) ring = new PinnedRing();
  return *ring;
}

// One CTA per chunk; 16-byte vectors when both ends are aligned, bytes otherwise. Each thread first issues
// kUnroll independent 16-byte loads, then stores them: kUnroll x 4 KB of a 256-thread CTA in flight at once,
// which a read over PCIe from mapped pinned host memory (~1-2 us per round trip) needs to approach the
// link's bandwidth; the tail of a chunk that does not fill a whole unrolled step goes one vector at a time.
constexpr int kUnroll = 8;

__global__ void gather_chunks_kernel(const CopyRun* __restrict__ chunks) {
  const CopyRun r = chunks[blockIdx.x];
  const char* src = reinterpret_cast<const char*>(r.src);
  char* dst = reinterpret_cast<char*>(r.dst);
  const bool aligned = ((r.src | r.dst | static_cast<std::uintptr_t>(r.bytes)) & 15) == 0;
  if (aligned) {
    const int4* __restrict__ s4 = reinterpret_cast<const int4*>(src);
    int4* __restrict__ d4 = reinterpret_cast<int4*>(dst);
    const std::int64_t n4 = r.bytes / 16;
    const std::int64_t step = blockDim.x;
    std::int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * step < n4; i += kUnroll * step) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = s4[i + u * step];
      __syncwarp();  // a memory-ordering point: the compiler issues all kUnroll loads before any store
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d4[i + u * step] = v[u];
    }
    for (; i < n4; i += step) d4[i] = s4[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) dst[i] = src[i];
  }
}

void gather(const std::vector<CopyRun>& chunks, cudaStream_t stream) {
  const std::size_t table_bytes = chunks.size() * sizeof(CopyRun);
  void* table = nullptr;
  check(cudaMallocAsync(&table, table_bytes, stream), "cudaMallocAsync");
  ring_of_current_device().upload(chunks.data(), table_bytes, table, stream);
  gather_chunks_kernel<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(
      static_cast<const CopyRun*>(table));
  check(cudaGetLastError(), "gather_chunks_kernel launch");
  check(cudaFreeAsync(table, stream), "cudaFreeAsync");
}
}  // namespace

void copy_segments_cuda(const SegmentArgs& args, std::uintptr_t stream_ptr, std::int64_t kernel_max_run_bytes,
                        std::int64_t kernel_min_runs) {
  std::vector<CopyRun> runs = build_runs(args);
  if (runs.empty()) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  const std::uintptr_t src_dev = device_address(args.src_ptr);
  const std::uintptr_t dst_dev = device_address(args.dst_ptr);
  const auto mask = kernel_run_mask(runs, kernel_max_run_bytes, kernel_min_runs, src_dev != 0 && dst_dev != 0);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (mask[i]) continue;
    const CopyRun& r = runs[i];
    check(cudaMemcpyAsync(reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src),
                          static_cast<std::size_t>(r.bytes), cudaMemcpyDefault, stream),
          "cudaMemcpyAsync");
  }
  std::vector<CopyRun> chunks = kernel_chunks(runs, mask, kChunkBytes);
  if (chunks.empty()) return;
  for (CopyRun& c : chunks) {  // rebase onto device addresses
    c.src = c.src - args.src_ptr + src_dev;
    c.dst = c.dst - args.dst_ptr + dst_dev;
  }
  gather(chunks, stream);
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace shadowprefill
