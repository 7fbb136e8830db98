// pybind11 bindings of the context index (private names; ngram_native/context.py is the public
// API and checks token ids and parameters). Batched tree building releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <vector>

#include "context_index.h"
#include "job_cache.h"

namespace py = pybind11;

namespace {

using I32Array = py::array_t<int32_t, py::array::c_style>;
using I64Array = py::array_t<int64_t, py::array::c_style>;

template <typename T>
py::array_t<T> copy_out(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

context::LookupParams lookup_params(int64_t budget, double depth_factor, int64_t max_occurrences) {
  context::LookupParams params;
  params.budget = budget;
  params.depth_factor = depth_factor;
  params.max_occurrences = max_occurrences;
  return params;
}

void check_batch(const std::vector<const context::ContextIndex*>& indexes, const I64Array& depth_caps) {
  if (depth_caps.ndim() != 1 || depth_caps.shape(0) != static_cast<py::ssize_t>(indexes.size())) {
    throw py::value_error("depth_caps must hold one entry per index");
  }
  for (const auto* index : indexes) {
    if (index == nullptr) throw py::value_error("indexes must not hold None");
  }
}

py::tuple tree_arrays(const trees::TreeBatch& out) {
  return py::make_tuple(copy_out(out.tokens), copy_out(out.parents), copy_out(out.depths),
                        copy_out(out.scores), copy_out(out.offsets));
}

}  // namespace

void bind_context(py::module_& m) {
  py::class_<context::ContextIndex>(m, "_ContextIndex")
      .def(py::init<int32_t, int32_t, int64_t>(), py::arg("min_match"), py::arg("max_match"),
           py::arg("max_tokens"))
      .def("append",
           [](context::ContextIndex& index, const I32Array& tokens) {
             if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
             index.append(tokens.data(), static_cast<size_t>(tokens.shape(0)));
           })
      .def("__len__", &context::ContextIndex::size)
      .def("tokens", [](const context::ContextIndex& index) { return copy_out(index.tokens()); })
      .def("match",
           [](const context::ContextIndex& index, int64_t max_occurrences) {
             std::vector<int32_t> ends;
             const int32_t length = index.match(max_occurrences, ends);
             return py::make_tuple(length, copy_out(ends));
           })
      .def_property_readonly("min_match", &context::ContextIndex::min_match)
      .def_property_readonly("max_match", &context::ContextIndex::max_match)
      .def_property_readonly("max_tokens", &context::ContextIndex::max_tokens);

  m.def(
      "_build_lookup_trees",
      [](const std::vector<const context::ContextIndex*>& indexes, const I64Array& depth_caps,
         const I32Array& eos_ids, int64_t budget, double depth_factor, int64_t max_occurrences) {
        check_batch(indexes, depth_caps);
        const context::LookupParams params = lookup_params(budget, depth_factor, max_occurrences);
        const trees::EosSet eos(std::vector<int32_t>(eos_ids.data(), eos_ids.data() + eos_ids.size()));
        const int64_t* caps = depth_caps.data();
        trees::TreeBatch out;
        {
          py::gil_scoped_release release;
          context::LookupScratch scratch;
          for (size_t b = 0; b < indexes.size(); ++b) {
            context::build_lookup_tree(*indexes[b], caps[b], params, eos, scratch, out);
          }
        }
        return tree_arrays(out);
      },
      py::arg("indexes"), py::arg("depth_caps"), py::arg("eos_ids"), py::arg("budget"),
      py::arg("depth_factor"), py::arg("max_occurrences"),
      "Candidate trees of a batch of context indexes -> (tokens, parents, depths, scores, offsets).");

  py::class_<context::JobCache>(m, "_JobCache")
      .def(py::init<int32_t, int32_t, int64_t>(), py::arg("min_match"), py::arg("max_match"),
           py::arg("max_tokens"))
      .def("add",
           [](context::JobCache& cache, const I32Array& tokens) {
             if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
             cache.add(tokens.data(), static_cast<size_t>(tokens.shape(0)));
           })
      .def("__len__", &context::JobCache::size)
      .def_property_readonly("num_documents", &context::JobCache::num_documents)
      .def_property_readonly("evicted_documents", &context::JobCache::evicted_documents)
      .def_property_readonly("memory_bytes", &context::JobCache::memory_bytes)
      .def_property_readonly("min_match", &context::JobCache::min_match)
      .def_property_readonly("max_match", &context::JobCache::max_match)
      .def_property_readonly("max_tokens", &context::JobCache::max_tokens)
      .def("stream", [](const context::JobCache& cache) { return copy_out(cache.live_stream()); })
      .def("match",
           [](const context::JobCache& cache, const I32Array& query, int64_t max_occurrences) {
             if (query.ndim() != 1) throw py::value_error("query must be 1-D");
             std::vector<int32_t> ends;
             const int32_t length = cache.match(query.data(), static_cast<size_t>(query.shape(0)),
                                                max_occurrences, ends);
             const int32_t start = static_cast<int32_t>(cache.chains().live_start());
             for (int32_t& e : ends) e -= start;  // positions in stream()
             return py::make_tuple(length, copy_out(ends));
           });

  m.def(
      "_build_job_cache_trees",
      [](const context::JobCache& cache, const std::vector<const context::ContextIndex*>& indexes,
         const I64Array& depth_caps, const I32Array& eos_ids, int64_t budget, double depth_factor,
         int64_t max_occurrences) {
        check_batch(indexes, depth_caps);
        const context::LookupParams params = lookup_params(budget, depth_factor, max_occurrences);
        const trees::EosSet eos(std::vector<int32_t>(eos_ids.data(), eos_ids.data() + eos_ids.size()));
        const int64_t* caps = depth_caps.data();
        trees::TreeBatch out;
        {
          py::gil_scoped_release release;
          context::LookupScratch scratch;
          for (size_t b = 0; b < indexes.size(); ++b) {
            context::build_job_cache_tree(cache, *indexes[b], caps[b], params, eos, scratch, out);
          }
        }
        return tree_arrays(out);
      },
      py::arg("cache"), py::arg("indexes"), py::arg("depth_caps"), py::arg("eos_ids"), py::arg("budget"),
      py::arg("depth_factor"), py::arg("max_occurrences"),
      "Job-cache trees of a batch of live sequences (their context indexes) -> (tokens, parents, depths, "
      "scores, offsets).");
}
