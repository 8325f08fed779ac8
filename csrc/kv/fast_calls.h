// The per-iteration KVCore calls as plain vectorcall builtins (fast_calls.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace shadowprefill {

// (allocate, commit, free, match, poll, allocate_many, commit_many) of `core` (positional arguments); each holds `core` alive.
py::tuple fast_calls(py::object core);

}  // namespace shadowprefill
