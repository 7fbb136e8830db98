// pybind11 bindings of the trie: reader (an NgramScorer), builder, upstream import.
// The Python-facing API with docs lives in ngram_native/trie.py, which wraps these.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>

#include "trie.h"

namespace py = pybind11;
using ngram::NgramTrie;
using ngram::TrieBuilder;

namespace {

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

py::tuple to_tuple(const std::vector<uint64_t>& v) {
  py::tuple t(v.size());
  for (size_t i = 0; i < v.size(); ++i) t[i] = py::int_(v[i]);
  return t;
}

py::dict stats_dict(const ngram::BuildStats& s) {
  py::dict d;
  d["num_documents"] = s.num_documents;
  d["num_tokens"] = s.num_tokens;
  d["num_runs"] = s.num_runs;
  d["file_size"] = s.file_size;
  d["level_sizes"] = to_tuple(s.level_sizes);
  return d;
}

using IdArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

}  // namespace

void bind_trie(py::module_& m) {
  auto& format_error = py::register_exception<ngram::TrieFormatError>(m, "TrieFormatError", PyExc_ValueError);
  py::register_exception<ngram::TokenizerMismatchError>(m, "TokenizerMismatchError", format_error.ptr());
  py::register_exception<ngram::TrieClosedError>(m, "TrieClosedError", PyExc_ValueError);
  // OS errors become the matching OSError subclass (FileNotFoundError, PermissionError, ...).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ngram::TrieIOError& e) {
      py::object err = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "iss", e.errno_value,
                                (e.action + ": " + std::strerror(e.errno_value)).c_str(), e.path.c_str()));
      if (err) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  py::class_<NgramTrie, ngram::NgramScorer>(m, "NgramTrie", "Memory-mapped N-gram trie file (see trie.py).")
      .def(py::init([](const std::string& path, bool verify, const std::string& expected_fingerprint) {
             py::gil_scoped_release release;
             return std::make_unique<NgramTrie>(path, verify, expected_fingerprint);
           }),
           py::arg("path"), py::arg("verify") = false, py::arg("expected_tokenizer_fingerprint") = "")
      .def_property_readonly("order", &NgramTrie::order)
      .def_property_readonly("vocab_size", &NgramTrie::vocab_size)
      .def_property_readonly("tokenizer_fingerprint", &NgramTrie::tokenizer_fingerprint)
      .def_property_readonly("level_sizes", [](const NgramTrie& t) { return to_tuple(t.level_sizes()); })
      .def_property_readonly("file_size", &NgramTrie::file_size)
      .def_property_readonly("min_count", &NgramTrie::min_count)
      .def_property_readonly("num_documents", &NgramTrie::num_documents)
      .def_property_readonly("path", &NgramTrie::path)
      .def_property_readonly("closed", &NgramTrie::closed)
      .def("count_width", &NgramTrie::count_width, py::arg("level"))
      .def("verify", &NgramTrie::verify, py::call_guard<py::gil_scoped_release>())
      .def("close", &NgramTrie::close)
      .def(
          "_count",
          [](const NgramTrie& t, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& ngram) {
            if (ngram.ndim() != 1) throw std::invalid_argument("ngram must be a 1-D sequence of token ids");
            return t.count(ngram.data(), static_cast<size_t>(ngram.shape(0)));
          },
          py::arg("ngram"))
      .def(
          "level_arrays",
          [](const NgramTrie& t, int level) {
            NgramTrie::LevelCopy c = t.copy_level(level);
            return py::make_tuple(to_numpy(c.tokens), to_numpy(c.counts), to_numpy(c.child_offsets));
          },
          py::arg("level"), "Copies (tokens u32, counts u64, child_offsets u64) of one level.");

  py::class_<TrieBuilder>(m, "TrieBuilder", "Bounded-memory k-gram counter writing a trie file (see trie.py).")
      .def(py::init([](int order, uint32_t vocab_size, const std::string& fingerprint, uint64_t chunk_tokens,
                       uint64_t min_count, const std::string& tmp_dir) {
             ngram::BuildOptions o;
             o.order = order;
             o.vocab_size = vocab_size;
             o.tokenizer_fingerprint = fingerprint;
             o.chunk_tokens = chunk_tokens;
             o.min_count = min_count;
             o.tmp_dir = tmp_dir;
             return std::make_unique<TrieBuilder>(std::move(o));
           }),
           py::arg("order"), py::arg("vocab_size"), py::arg("tokenizer_fingerprint"), py::arg("chunk_tokens"),
           py::arg("min_count"), py::arg("tmp_dir"))
      .def(
          "add_document",
          [](TrieBuilder& b, const py::array_t<int64_t, py::array::c_style>& ids) {
            if (ids.ndim() != 1) throw std::invalid_argument("a document must be a 1-D array of token ids");
            const int64_t* data = ids.data();
            const size_t len = static_cast<size_t>(ids.shape(0));
            py::gil_scoped_release release;
            b.add_document(data, len);
          },
          py::arg("ids"))
      .def(
          "finish",
          [](TrieBuilder& b, const std::string& path) {
            ngram::BuildStats s;
            {
              py::gil_scoped_release release;
              s = b.finish(path);
            }
            return stats_dict(s);
          },
          py::arg("path"))
      .def_property_readonly("num_documents", &TrieBuilder::num_documents)
      .def_property_readonly("num_tokens", &TrieBuilder::num_tokens);

  m.def(
      "import_upstream_trie",
      [](const std::string& src, const std::string& dst, uint32_t vocab_size, const std::string& fingerprint,
         const std::string& tmp_dir) {
        ngram::BuildStats s;
        {
          py::gil_scoped_release release;
          s = ngram::import_upstream_trie(src, dst, vocab_size, fingerprint, tmp_dir);
        }
        return stats_dict(s);
      },
      py::arg("src_path"), py::arg("dst_path"), py::arg("vocab_size"), py::arg("tokenizer_fingerprint"),
      py::arg("tmp_dir"));

  m.attr("TRIE_HEADER_SIZE") = py::int_(ngram::kHeaderSize);
  m.attr("TRIE_FORMAT_VERSION") = py::int_(ngram::kTrieFormatVersion);
  m.def(
      "read_trie_header",
      [](const py::bytes& head, uint64_t file_size, const std::string& name) {
        std::string_view v = head;
        const ngram::FileHeader h =
            ngram::read_header(reinterpret_cast<const unsigned char*>(v.data()), v.size(), file_size, name);
        py::dict d;
        d["format_version"] = h.format_version;
        d["order"] = h.order;
        d["vocab_size"] = h.vocab_size;
        d["tokenizer_fingerprint"] = ngram::stored_fingerprint(h);
        d["file_size"] = h.file_size;
        d["payload_checksum"] = h.payload_checksum;
        d["min_count"] = h.min_count;
        d["num_documents"] = h.num_documents;
        d["level_sizes"] = to_tuple(ngram::stored_level_sizes(h));
        return d;
      },
      py::arg("head"), py::arg("file_size"), py::arg("name") = "",
      "Validates a trie header from the file's first bytes and its size (see trie.py).");

  m.def(
      "_xxh64",
      [](const py::bytes& data, uint64_t seed) {
        std::string_view v = data;
        return ngram::xxh64(v.data(), v.size(), seed);
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of bytes (exposed to test the checksum).");
}
