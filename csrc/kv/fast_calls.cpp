// Fast calls: the per-iteration KVCore methods as plain vectorcall builtins (METH_FASTCALL), bound to a
// capsule holding the core; they skip pybind11's dispatcher (its argument loading costs more than most calls).
// Same arguments, results and exceptions as the pybind11 methods. The method calls (fast_method_calls) take
// the manager's keyword arguments as well and skip its Python frame.
#include "fast_calls.h"

#include <iterator>
#include <vector>

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

PyMethodDef kFastCalls[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_allocate)), METH_FASTCALL, nullptr},
    {"commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_commit)), METH_FASTCALL, nullptr},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_free)), METH_FASTCALL, nullptr},
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_match)), METH_FASTCALL, nullptr},
    {"poll", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_poll)), METH_FASTCALL, nullptr},
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

// ---- the manager's methods --------------------------------------------------------------------------------
// self of a method call: (capsule, manager weakref, Python method)
PyObject* pass_on(PyObject* self, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* manager = PyWeakref_GetObject(PyTuple_GET_ITEM(self, 1));  // borrowed
  if (manager == Py_None) {
    PyErr_SetString(PyExc_ReferenceError, "the KVCacheManager is gone");
    return nullptr;
  }
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  std::vector<PyObject*> args(static_cast<size_t>(total) + 1);
  args[0] = manager;
  for (Py_ssize_t i = 0; i < total; ++i) args[static_cast<size_t>(i) + 1] = a[i];
  return PyObject_Vectorcall(PyTuple_GET_ITEM(self, 2), args.data(), static_cast<size_t>(nargs) + 1, kwnames);
}

// Keyword arguments by name: out[i] = the value of names[i] (nullptr if not given); false if a keyword is
// not among names or given twice.
bool bind_keywords(PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames, const char* const* names,
                   PyObject* const* interned, int n, PyObject** out) {
  for (int i = 0; i < n; ++i) out[i] = nullptr;
  if (!kwnames) return true;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int i = 0;
    while (i < n && key != interned[i]) ++i;  // keywords written in the source are interned
    if (i == n) {
      i = 0;
      while (i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) ++i;
    }
    if (i == n || out[i]) return false;
    out[i] = a[nargs + k];
  }
  return true;
}

// allocate(n, *, now, shadow=False)
PyObject* method_allocate(PyObject* self, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"now", "shadow"};
  static PyObject* const interned[] = {PyUnicode_InternFromString(names[0]), PyUnicode_InternFromString(names[1])};
  PyObject* kw[2];
  int64_t n;
  double now;
  bool shadow = false;
  if (nargs != 1 || !bind_keywords(a, nargs, kwnames, names, interned, 2, kw) || !kw[0] || !PyLong_CheckExact(a[0]))
    return pass_on(self, a, nargs, kwnames);
  if (!fast_int(a[0], n) || n < 0 || !fast_double(kw[0], now) || (kw[1] && !fast_bool(kw[1], shadow))) {
    PyErr_Clear();  // the method raises its own error
    return pass_on(self, a, nargs, kwnames);
  }
  KVCore* core = fast_core(PyTuple_GET_ITEM(self, 0));
  return guarded([&] { return core->allocate(n, now, shadow).release().ptr(); });
}

// commit(block_ids, token_ids, *, now, tenant="", num_tokens=None, hashes=None)
PyObject* method_commit(PyObject* self, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"now", "tenant", "num_tokens", "hashes"};
  static PyObject* const interned[] = {PyUnicode_InternFromString(names[0]), PyUnicode_InternFromString(names[1]),
                                       PyUnicode_InternFromString(names[2]), PyUnicode_InternFromString(names[3])};
  PyObject* kw[4];
  double now;
  if (nargs != 2 || !bind_keywords(a, nargs, kwnames, names, interned, 4, kw) || !kw[0] || !PyList_CheckExact(a[1]))
    return pass_on(self, a, nargs, kwnames);  // (token lists that are not lists are converted there)
  if (!fast_double(kw[0], now)) {
    PyErr_Clear();
    return pass_on(self, a, nargs, kwnames);
  }
  KVCore* core = fast_core(PyTuple_GET_ITEM(self, 0));
  static PyObject* empty = PyUnicode_FromString("");  // the default tenant
  if (!empty) return nullptr;
  return guarded([&] {
    return PyLong_FromLongLong(core->commit(borrow(a[0]), borrow(a[1]), now, borrow(kw[1] ? kw[1] : empty),
                                            borrow(kw[2] ? kw[2] : Py_None), borrow(kw[3] ? kw[3] : Py_None)));
  });
}

PyMethodDef kMethodCalls[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(method_allocate)),
     METH_FASTCALL | METH_KEYWORDS, "KVCacheManager.allocate (native fast path)"},
    {"commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(method_commit)),
     METH_FASTCALL | METH_KEYWORDS, "KVCacheManager.commit (native fast path)"},
};

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

py::tuple fast_method_calls(py::object core, py::object manager_ref, py::object allocate, py::object commit) {
  if (!PyWeakref_CheckRef(manager_ref.ptr())) throw py::type_error("manager_ref: expected a weakref");
  py::object capsule = core_capsule(std::move(core));
  py::object methods[] = {allocate, commit};
  py::tuple out(std::size(kMethodCalls));
  for (size_t i = 0; i < std::size(kMethodCalls); ++i) {
    py::tuple self = py::make_tuple(capsule, manager_ref, methods[i]);
    PyObject* f = PyCFunction_New(&kMethodCalls[i], self.ptr());
    if (!f) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, f);
  }
  return out;
}

}  // namespace shadowprefill
