// shadowprefill._C_kv: the native KV core (KVCore), its page-hash chains (PageChain), the native HostIndex
// and page_hashes(). CPU-only bookkeeping, no libtorch; shadowprefill/kv/native.py loads it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>

#include "fast_calls.h"
#include "kv_core.h"
#include "py_convert.h"

namespace py = pybind11;
using namespace shadowprefill;

namespace {

py::list hashes_to_list(const std::vector<H128>& hashes) {
  py::list out;
  for (const H128& h : hashes) out.append(h128_to_int(h));
  return out;
}

}  // namespace

PYBIND11_MODULE(_C_kv, m) {
  m.doc() = "shadowprefill native KV core: page pool, prefix index, host index, page-hash chains";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TokenValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TokenTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  m.def("salt_root", [](const std::string& salt) { return h128_to_int(salt_root(salt)); }, py::arg("salt"),
        "The root hash of a salt's chains (kv.page_hash.salt_root).");
  m.def(
      "page_hashes",
      [](py::object tokens, int64_t block_size, const std::string& salt) {
        if (block_size <= 0) throw py::value_error("block_size: expected an int > 0, got " + std::to_string(block_size));
        Tokens t(tokens.ptr());
        PageHasher hasher(static_cast<int>(block_size));
        std::vector<H128> out;
        H128 h = salt_root(salt);
        for (int64_t i = 0; i < t.size() / block_size; ++i) out.push_back(h = hasher.next(h, t, i));
        return hashes_to_list(out);
      },
      py::arg("tokens"), py::arg("block_size"), py::arg("salt") = "",
      "kv.page_hashes of a list or tuple of token ids (same values as the Python definition).");

  py::class_<PageChain, std::shared_ptr<PageChain>>(m, "PageChain",
                                                     "The kept page hashes of an append-only token list.")
      .def("__len__", [](const PageChain& c) { return c.hashes.size(); })
      .def("extend_to", &PageChain::extend_to, py::arg("num_pages"))
      .def("truncate", &PageChain::truncate, py::arg("num_pages"))
      .def("retarget", &PageChain::retarget, py::arg("tokens"), py::arg("keep_pages"))
      .def_property_readonly("tokens", [](const PageChain& c) { return c.tokens; })
      .def_property_readonly("block_size", [](const PageChain& c) { return c.block_size; })
      .def_property_readonly("root", [](const PageChain& c) { return h128_to_int(c.root); })
      .def_property_readonly("hashes", [](const PageChain& c) { return hashes_to_list(c.hashes); })
      .def_property_readonly("pages", [](const PageChain& c) { return to_list(c.pages); },
                             "The device pages the last manager that used the chain found its first hashes on.");

  py::class_<HostIndex>(m, "HostIndex", "Host tier entries: page hash -> slot, LRU, a class per slot.")
      .def(py::init<int64_t>(), py::arg("num_pages"))
      .def_property_readonly_static("backend", [](py::object) { return "native"; })
      .def_readonly("num_pages", &HostIndex::num_pages)
      .def_readonly("num_shadow", &HostIndex::num_shadow)
      .def_property_readonly("num_used", &HostIndex::num_used)
      .def("peek", [](const HostIndex& x, py::handle h) { return x.peek(int_to_h128(h)); })
      .def("get", [](HostIndex& x, py::handle h) { return x.get(int_to_h128(h)); })
      .def("is_shadow", &HostIndex::is_shadow)
      .def("set_class", &HostIndex::set_class)
      .def("items", [](const HostIndex& x) {
        py::list out;
        x.for_each([&](const H128& h, int32_t slot) { out.append(py::make_tuple(h128_to_int(h), slot)); });
        return out;
      })
      .def("put_many", [](HostIndex& x, py::list hashes, py::object shadows) {
        std::vector<H128> hs;
        for (py::handle h : hashes) hs.push_back(int_to_h128(h));
        std::vector<uint8_t> cls;
        if (!shadows.is_none())
          for (py::handle s : shadows) cls.push_back(py::cast<bool>(s));
        std::vector<int32_t> slots;
        std::vector<uint8_t> copy;
        std::vector<std::pair<H128, bool>> dropped;
        x.put_many(hs, shadows.is_none() ? nullptr : &cls, slots, copy, dropped);
        py::list copy_out, dropped_out;
        for (uint8_t c : copy) copy_out.append(c != 0);
        for (const auto& d : dropped) dropped_out.append(py::make_tuple(h128_to_int(d.first), d.second));
        return py::make_tuple(to_list(slots), copy_out, dropped_out);
      });

  py::class_<KVCore>(m, "KVCore", "Native twin of shadowprefill.kv.core.KVCore (same methods, same decisions).")
      .def(py::init<int32_t, int, int64_t, double, std::string, py::object, int64_t, py::object>(),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("shadow_cap"), py::arg("cold_age_s"),
           py::arg("model_id"), py::arg("host_index"), py::arg("page_bytes"), py::arg("copy"))
      .def("counts", &KVCore::counts)
      .def("page", &KVCore::page)
      .def("stats_dict", &KVCore::stats_dict)
      .def("snapshot", &KVCore::snapshot)
      .def("hash_chain", &KVCore::hash_chain)
      .def("peek", &KVCore::peek)
      .def("available", &KVCore::available)
      .def("match", &KVCore::match)
      .def("allocate", &KVCore::allocate)
      .def("allocate_up_to", &KVCore::allocate_up_to)
      .def("commit", &KVCore::commit)
      .def("allocate_many", &KVCore::allocate_many)
      .def("commit_many", &KVCore::commit_many)
      .def("free", &KVCore::free)
      .def("touch", &KVCore::touch)
      .def("poll", &KVCore::poll)
      .def("_set_memo_key_bits", &KVCore::set_memo_key_bits, py::arg("bits"),
           "Test hook: keep only the low bits of the hash memo's keys (forced collisions; results unchanged).")
      .def("fast_calls", &fast_calls,
           "(allocate, commit, free, match, poll, allocate_many, commit_many): the same methods as vectorcall builtins (positional arguments).");
}
