// pybind11 entry point of ngram_native._core: each part binds itself.
#include <pybind11/pybind11.h>

#include "ngram_scorer.h"

namespace py = pybind11;

void bind_trie(py::module_& m);   // bind_trie.cpp
void bind_trees(py::module_& m);  // bind_trees.cpp
void bind_context(py::module_& m);  // bind_context.cpp
void bind_job_ngram(py::module_& m);  // bind_job_ngram.cpp

PYBIND11_MODULE(_core, m) {
  m.doc() = "N-gram trie file format and draft-tree builders for DART speculative decoding";
  py::class_<ngram::NgramScorer>(m, "NgramScorer");
  bind_trie(m);
  bind_trees(m);
  bind_context(m);
  bind_job_ngram(m);
}
