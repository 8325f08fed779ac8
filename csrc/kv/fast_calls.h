// The per-iteration KVCore calls as plain vectorcall builtins (fast_calls.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace shadowprefill {

// (allocate, commit, free, match, poll) of `core` (positional arguments); each holds `core` alive.
py::tuple fast_calls(py::object core);

// (allocate, commit) with the manager methods' signatures (KVCacheManager.allocate / .commit): the common
// calls run here without a Python frame; any other call (a keyword they do not take, an argument they would
// convert or reject) is passed on to the Python method, `allocate` / `commit`, of the manager `manager_ref`
// (a weakref) unchanged, so results and errors are the methods'.
py::tuple fast_method_calls(py::object core, py::object manager_ref, py::object allocate, py::object commit);

}  // namespace shadowprefill
