// pybind11 bindings of the job n-gram scorer (private name; the public API with input checking
// and documentation is ngram_native/job_ngram.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "job_ngram.h"

namespace py = pybind11;

void bind_job_ngram(py::module_& m) {
  using ngram::JobNgram;
  using I32Array = py::array_t<int32_t, py::array::c_style>;
  py::class_<JobNgram, ngram::NgramScorer>(m, "_JobNgram")
      // keep_alive: the static scorer (argument 4) lives at least as long as this one.
      .def(py::init<int, int64_t, const ngram::NgramScorer*, double>(), py::arg("order"), py::arg("max_tokens"),
           py::arg("base").none(true), py::arg("prior"), py::keep_alive<1, 4>())
      .def("add",
           [](JobNgram& self, const I32Array& tokens) {
             if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
             self.add(tokens.data(), static_cast<size_t>(tokens.shape(0)));
           })
      .def("count",
           [](const JobNgram& self, const I32Array& tokens) {
             if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
             return self.count(tokens.data(), static_cast<size_t>(tokens.shape(0)));
           })
      .def("score_job",
           [](const JobNgram& self, const I32Array& context, const I32Array& candidates) {
             if (context.ndim() != 1 || candidates.ndim() != 1) {
               throw py::value_error("context and candidates must be 1-D");
             }
             py::array_t<float> out(candidates.shape(0));
             const uint64_t c = self.score_job(context.data(), static_cast<size_t>(context.shape(0)),
                                               candidates.data(), static_cast<size_t>(candidates.shape(0)),
                                               out.mutable_data());
             return py::make_tuple(out, c);
           })
      .def("__len__", &JobNgram::size)
      .def_property_readonly("order", &JobNgram::order)
      .def_property_readonly("own_order", &JobNgram::own_order)
      .def_property_readonly("prior", &JobNgram::prior)
      .def_property_readonly("max_tokens", &JobNgram::max_tokens)
      .def_property_readonly("num_documents", &JobNgram::num_documents)
      .def_property_readonly("evicted_documents", &JobNgram::evicted_documents)
      .def_property_readonly("distinct_ngrams", &JobNgram::distinct_ngrams)
      .def_property_readonly("memory_bytes", &JobNgram::memory_bytes);
}
