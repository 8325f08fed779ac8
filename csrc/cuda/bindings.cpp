// shadowprefill._C_cuda: page copies enqueued on a CUDA stream (cudart linked statically, so the
// module only loads where a driver exists and the package imports fine without one).
#include <pybind11/pybind11.h>

#include "../segments.h"

namespace py = pybind11;

namespace shadowprefill {
void copy_segments_cuda(const SegmentArgs& args, std::uintptr_t stream_ptr, std::int64_t kernel_max_run_bytes,
                        std::int64_t kernel_min_runs);
int cuda_device_count();
}

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "shadowprefill CUDA page copies (device pages <-> pinned host / contiguous device buffers)";
  m.def(
      "copy_segments",
      [](std::uintptr_t src_ptr, std::uintptr_t dst_ptr, std::uintptr_t src_ids_ptr, std::uintptr_t dst_ids_ptr,
         std::int64_t n, std::int64_t src_stride, std::int64_t dst_stride, std::int64_t src_offset,
         std::int64_t dst_offset, std::int64_t seg_bytes, std::uintptr_t stream_ptr, std::int64_t src_count,
         std::int64_t dst_count, std::int64_t kernel_max_run_bytes, std::int64_t kernel_min_runs) {
        shadowprefill::SegmentArgs a{src_ptr,    dst_ptr,    src_ids_ptr, dst_ids_ptr, n,         src_stride,
                                     dst_stride, src_offset, dst_offset,  seg_bytes,   src_count, dst_count};
        py::gil_scoped_release release;
        shadowprefill::copy_segments_cuda(a, stream_ptr, kernel_max_run_bytes, kernel_min_runs);
      },
      py::arg("src_ptr"), py::arg("dst_ptr"), py::arg("src_ids_ptr"), py::arg("dst_ids_ptr"), py::arg("n"),
      py::arg("src_stride"), py::arg("dst_stride"), py::arg("src_offset"), py::arg("dst_offset"),
      py::arg("seg_bytes"), py::arg("stream_ptr"), py::arg("src_count") = -1, py::arg("dst_count") = -1,
      py::arg("kernel_max_run_bytes") = 256 << 10, py::arg("kernel_min_runs") = 4,
      "Same contract as _C.copy_segments (ids are int64 host arrays), enqueued on stream_ptr; returns at once. "
      "Merged runs of at least kernel_max_run_bytes are one cudaMemcpyAsync each; smaller runs go to one "
      "gather kernel when there are at least kernel_min_runs of them and both sides are device-addressable.");
  m.def("device_count", &shadowprefill::cuda_device_count, "CUDA devices visible to this module's runtime.");
}
