// CUDA page copies between device pages, pinned host memory and contiguous device buffers.
//
// Few merged runs: one cudaMemcpyAsync each (the copy engines reach full PCIe / HBM bandwidth).
// Many runs: one gather kernel over a run table, when both sides are device-addressable (device
// memory, or pinned host memory mapped into the device address space). Everything is enqueued on
// the caller's stream; nothing blocks the host.
#include <cuda_runtime.h>

#include <string>

#include "../segments.h"

namespace shadowprefill {

namespace {
constexpr std::size_t kMaxMemcpyRuns = 16;
constexpr int kThreads = 256;

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

// One block per run; 16-byte vectors when both ends are aligned, bytes otherwise.
__global__ void gather_runs_kernel(const CopyRun* __restrict__ runs) {
  const CopyRun r = runs[blockIdx.x];
  const char* src = reinterpret_cast<const char*>(r.src);
  char* dst = reinterpret_cast<char*>(r.dst);
  const bool aligned = ((r.src | r.dst | static_cast<std::uintptr_t>(r.bytes)) & 15) == 0;
  if (aligned) {
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    const std::int64_t n4 = r.bytes / 16;
    for (std::int64_t i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) dst[i] = src[i];
  }
}
}  // namespace

void copy_segments_cuda(const SegmentArgs& args, std::uintptr_t stream_ptr) {
  std::vector<CopyRun> runs = build_runs(args);
  if (runs.empty()) return;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  const std::uintptr_t src_dev = device_address(args.src_ptr);
  const std::uintptr_t dst_dev = device_address(args.dst_ptr);
  if (runs.size() <= kMaxMemcpyRuns || src_dev == 0 || dst_dev == 0) {
    for (const CopyRun& r : runs)
      check(cudaMemcpyAsync(reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src),
                            static_cast<std::size_t>(r.bytes), cudaMemcpyDefault, stream),
            "cudaMemcpyAsync");
    return;
  }
  // Rebase the run table onto device addresses and launch one gather kernel.
  for (CopyRun& r : runs) {
    r.src = r.src - args.src_ptr + src_dev;
    r.dst = r.dst - args.dst_ptr + dst_dev;
  }
  const std::size_t table_bytes = runs.size() * sizeof(CopyRun);
  void* table = nullptr;
  check(cudaMallocAsync(&table, table_bytes, stream), "cudaMallocAsync");
  // Pageable source: returns once staged, so `runs` may go out of scope afterwards.
  check(cudaMemcpyAsync(table, runs.data(), table_bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(table)");
  gather_runs_kernel<<<static_cast<unsigned>(runs.size()), kThreads, 0, stream>>>(static_cast<const CopyRun*>(table));
  check(cudaGetLastError(), "gather_runs_kernel launch");
  check(cudaFreeAsync(table, stream), "cudaFreeAsync");
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
