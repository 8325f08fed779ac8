// shadowprefill._C: CPU page copies on raw host addresses (no libtorch linkage, so one build
// works with any torch version). The Python ops in shadowprefill/ops validate tensors first.
#include <pybind11/pybind11.h>

#include "../segments.h"

namespace py = pybind11;

namespace shadowprefill {
void copy_segments_cpu(const SegmentArgs& args, int num_threads);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "shadowprefill CPU page copy / gather / scatter";
  m.def(
      "copy_segments",
      [](std::uintptr_t src_ptr, std::uintptr_t dst_ptr, std::uintptr_t src_ids_ptr, std::uintptr_t dst_ids_ptr,
         std::int64_t n, std::int64_t src_stride, std::int64_t dst_stride, std::int64_t src_offset,
         std::int64_t dst_offset, std::int64_t seg_bytes, int num_threads, std::int64_t src_count,
         std::int64_t dst_count) {
        shadowprefill::SegmentArgs a{src_ptr,    dst_ptr,    src_ids_ptr, dst_ids_ptr, n,         src_stride,
                                     dst_stride, src_offset, dst_offset,  seg_bytes,   src_count, dst_count};
        py::gil_scoped_release release;
        shadowprefill::copy_segments_cpu(a, num_threads);
      },
      py::arg("src_ptr"), py::arg("dst_ptr"), py::arg("src_ids_ptr"), py::arg("dst_ids_ptr"), py::arg("n"),
      py::arg("src_stride"), py::arg("dst_stride"), py::arg("src_offset"), py::arg("dst_offset"),
      py::arg("seg_bytes"), py::arg("num_threads") = 0, py::arg("src_count") = -1, py::arg("dst_count") = -1,
      "For i < n copy seg_bytes from src_ptr+src_offset+src_ids[i]*src_stride to "
      "dst_ptr+dst_offset+dst_ids[i]*dst_stride (ids: int64 host arrays, 0 = identity). Runs of "
      "consecutive ids merge; large copies use num_threads threads (0 = all cores). Ids outside "
      "[0, src_count) / [0, dst_count) raise IndexError when the counts are given.");
  m.def("num_runs", [](std::uintptr_t src_ids_ptr, std::uintptr_t dst_ids_ptr, std::int64_t n, std::int64_t stride) {
    shadowprefill::SegmentArgs a{1, 1, src_ids_ptr, dst_ids_ptr, n, stride, stride, 0, 0, stride, -1, -1};
    return static_cast<std::int64_t>(shadowprefill::build_runs(a).size());
  }, "Number of merged copies a page list of this stride turns into (for tests and benchmarks).");
  m.def(
      "copy_path",
      [](std::uintptr_t src_ids_ptr, std::uintptr_t dst_ids_ptr, std::int64_t n, std::int64_t page_bytes,
         std::int64_t kernel_max_run_bytes, std::int64_t kernel_min_runs, std::int64_t chunk_bytes) {
        shadowprefill::SegmentArgs a{1,          1, src_ids_ptr, dst_ids_ptr, n, page_bytes, page_bytes, 0, 0,
                                     page_bytes, -1, -1};
        const auto runs = shadowprefill::build_runs(a);
        const auto mask = shadowprefill::kernel_run_mask(runs, kernel_max_run_bytes, kernel_min_runs, true);
        std::int64_t kernel_runs = 0;
        for (auto m : mask) kernel_runs += m;
        const auto chunks = shadowprefill::kernel_chunks(runs, mask, chunk_bytes);
        return py::make_tuple(static_cast<std::int64_t>(runs.size()) - kernel_runs, kernel_runs,
                              static_cast<std::int64_t>(chunks.size()));
      },
      py::arg("src_ids_ptr"), py::arg("dst_ids_ptr"), py::arg("n"), py::arg("page_bytes"),
      py::arg("kernel_max_run_bytes"), py::arg("kernel_min_runs"), py::arg("chunk_bytes"),
      "The CUDA path's decision for a page list on device-addressable memory, computed on the host with the "
      "same code: (runs copied with cudaMemcpyAsync, runs given to the gather kernel, kernel chunks).");
}
