// Conversions between Python objects and the native KV core's types: 128-bit page hashes as Python ints,
// page-id lists, copy events.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "page_hash.h"

namespace py = pybind11;

namespace shadowprefill {

inline py::object h128_to_int(const H128& h) {
  py::object hi = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(h.hi));
  py::object lo = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(h.lo));
  py::object shift = py::reinterpret_steal<py::object>(PyLong_FromLong(64));
  py::object up = py::reinterpret_steal<py::object>(PyNumber_Lshift(hi.ptr(), shift.ptr()));
  if (!up) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(PyNumber_Or(up.ptr(), lo.ptr()));
  if (!out) throw py::error_already_set();
  return out;
}

inline H128 int_to_h128(py::handle v) {  // the low 128 bits of a Python int
  if (!PyLong_Check(v.ptr())) throw py::type_error("page hash: expected an int");
  H128 h;
  h.lo = PyLong_AsUnsignedLongLongMask(v.ptr());
  py::object shift = py::reinterpret_steal<py::object>(PyLong_FromLong(64));
  py::object up = py::reinterpret_steal<py::object>(PyNumber_Rshift(v.ptr(), shift.ptr()));
  if (!up) throw py::error_already_set();
  h.hi = PyLong_AsUnsignedLongLongMask(up.ptr());
  return h;
}

inline py::list to_list(const std::vector<int32_t>& ids) {
  py::list out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) PyList_SET_ITEM(out.ptr(), i, PyLong_FromLong(ids[i]));
  return out;
}

inline bool event_done(const py::object& event) { return event.attr("query")().cast<bool>(); }

// seq as a list or tuple (PySequence_Fast: in place when it is one); TypeError(message) if not a sequence.
inline py::object fast_sequence(py::handle seq, const char* message) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), message));
  if (!fast) {
    PyErr_Clear();
    throw py::type_error(message);
  }
  return fast;
}

// A sequence of page ids (list, tuple or any sequence), read in place where possible.
class PageIds {
 public:
  explicit PageIds(py::handle seq) {
    fast_ = fast_sequence(seq, "block_ids: expected a sequence of page ids");
    n_ = PySequence_Fast_GET_SIZE(fast_.ptr());
    items_ = PySequence_Fast_ITEMS(fast_.ptr());
  }
  int64_t size() const { return n_; }
  void prefetch(int64_t i) const { __builtin_prefetch(reinterpret_cast<const char*>(items_[i]) + 8); }
  int64_t at(int64_t i) const {
    long long v;
    if (small_int(items_[i], v)) return v;
    v = PyLong_AsLongLong(items_[i]);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::type_error("block_ids: expected int page ids");
    }
    return v;
  }

 private:
  py::object fast_;
  PyObject** items_ = nullptr;
  Py_ssize_t n_ = 0;
};

}  // namespace shadowprefill
