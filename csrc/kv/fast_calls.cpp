// Fast calls: the per-iteration KVCore methods as plain vectorcall builtins (METH_FASTCALL), bound to a
// capsule holding the core; they skip pybind11's dispatcher (its argument loading costs more than most calls).
// Same arguments, results and exceptions as the pybind11 methods.
#include "fast_calls.h"

#include <iterator>

#include "kv_core.h"

namespace shadowprefill {
namespace {


// Runs f (returning a new reference), turning C++ exceptions into Python ones as the module does.
template <class F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const TokenValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TokenTypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

KVCore* fast_core(PyObject* capsule) { return static_cast<KVCore*>(PyCapsule_GetPointer(capsule, "KVCore")); }

bool fast_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s(): expected %zd positional arguments, got %zd", name, want, nargs);
  return false;
}

// pybind11's conversions: double (int or float), int64 (int, no float), bool (True/False/None/__bool__ of numbers)
bool fast_double(PyObject* o, double& v) {
  v = PyFloat_AsDouble(o);
  return !(v == -1.0 && PyErr_Occurred());
}
bool fast_int(PyObject* o, int64_t& v) {
  if (PyFloat_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "expected an int, got float");
    return false;
  }
  v = PyLong_AsLongLong(o);
  return !(v == -1 && PyErr_Occurred());
}
bool fast_bool(PyObject* o, bool& v) {
  if (o == Py_True || o == Py_False || o == Py_None) {
    v = o == Py_True;
    return true;
  }
  PyNumberMethods* num = Py_TYPE(o)->tp_as_number;
  if (num && num->nb_bool) {
    const int r = num->nb_bool(o);
    if (r >= 0) {
      v = r != 0;
      return true;
    }
    return false;
  }
  PyErr_Format(PyExc_TypeError, "expected a bool, got %s", Py_TYPE(o)->tp_name);
  return false;
}

py::object borrow(PyObject* o) { return py::reinterpret_borrow<py::object>(o); }

PyObject* fast_allocate(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (n, now, shadow)
  int64_t n;
  double now;
  bool shadow;
  if (!fast_nargs("allocate", nargs, 3) || !fast_int(a[0], n) || !fast_double(a[1], now) || !fast_bool(a[2], shadow))
    return nullptr;
  return guarded([&] { return fast_core(self)->allocate(n, now, shadow).release().ptr(); });
}

PyObject* fast_commit(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (pages, tokens, now, tenant, num_tokens, hashes)
  double now;
  if (!fast_nargs("commit", nargs, 6) || !fast_double(a[2], now)) return nullptr;
  return guarded([&] {
    return PyLong_FromLongLong(fast_core(self)->commit(borrow(a[0]), borrow(a[1]), now, borrow(a[3]), borrow(a[4]),
                                                       borrow(a[5])));
  });
}

PyObject* fast_free(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (pages, now)
  double now;
  if (!fast_nargs("free", nargs, 2) || !fast_double(a[1], now)) return nullptr;
  return guarded([&] {
    fast_core(self)->free(borrow(a[0]), now);
    Py_RETURN_NONE;
  });
}

PyObject* fast_match(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (tokens, now, tenant, shadow, promote, limit, hashes)
  double now;
  bool shadow, promote;
  int64_t limit;
  if (!fast_nargs("match", nargs, 7) || !fast_double(a[1], now) || !fast_bool(a[3], shadow) || !fast_bool(a[4], promote) ||
      !fast_int(a[5], limit))
    return nullptr;
  return guarded([&] {
    return fast_core(self)->match(borrow(a[0]), now, borrow(a[2]), shadow, promote, limit, borrow(a[6])).release().ptr();
  });
}

PyObject* fast_poll(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (now)
  double now;
  if (!fast_nargs("poll", nargs, 1) || !fast_double(a[0], now)) return nullptr;
  return guarded([&] {
    fast_core(self)->poll(now);
    Py_RETURN_NONE;
  });
}

PyObject* fast_allocate_many(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (counts, now, shadow)
  double now;
  bool shadow;
  if (!fast_nargs("allocate_many", nargs, 3) || !fast_double(a[1], now) || !fast_bool(a[2], shadow)) return nullptr;
  return guarded([&] { return fast_core(self)->allocate_many(borrow(a[0]), now, shadow).release().ptr(); });
}

PyObject* fast_commit_many(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {  // (items, now)
  double now;
  if (!fast_nargs("commit_many", nargs, 2) || !fast_double(a[1], now)) return nullptr;
  return guarded([&] { return PyLong_FromLongLong(fast_core(self)->commit_many(borrow(a[0]), now)); });
}

PyMethodDef kFastCalls[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_allocate)), METH_FASTCALL, nullptr},
    {"commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_commit)), METH_FASTCALL, nullptr},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_free)), METH_FASTCALL, nullptr},
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_match)), METH_FASTCALL, nullptr},
    {"poll", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_poll)), METH_FASTCALL, nullptr},
    {"allocate_many", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_allocate_many)), METH_FASTCALL,
     nullptr},
    {"commit_many", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_commit_many)), METH_FASTCALL, nullptr},
};

py::object core_capsule(py::object core) {  // a capsule of the core that holds it alive
  KVCore* c = core.cast<KVCore*>();
  PyObject* owner = core.release().ptr();  // the capsule's reference, dropped by its destructor
  py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(c, "KVCore", [](PyObject* cap) {
    Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(cap)));
  }));
  if (!capsule) {
    Py_DECREF(owner);
    throw py::error_already_set();
  }
  PyCapsule_SetContext(capsule.ptr(), owner);
  return capsule;
}

}  // namespace

py::tuple fast_calls(py::object core) {
  py::object capsule = core_capsule(std::move(core));
  py::tuple out(std::size(kFastCalls));
  for (size_t i = 0; i < std::size(kFastCalls); ++i) {
    PyObject* f = PyCFunction_New(&kFastCalls[i], capsule.ptr());
    if (!f) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, f);
  }
  return out;
}

}  // namespace shadowprefill
