// pybind11 bindings of the draft-tree builders and of the tree merge (private names; the public
// API with full input checking and documentation is ngram_native/builders.py and trees.py).
// This layer re-checks only what memory safety needs (ranks, shapes, offsets) and releases the
// GIL around the work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ngram_scorer.h"
#include "trees.h"
#include "trees_dict_scorer.h"

namespace py = pybind11;

namespace {

// No forcecast: trees.py converts dtypes explicitly, so nothing is cast silently here.
using F32Array = py::array_t<float, py::array::c_style>;
using I32Array = py::array_t<int32_t, py::array::c_style>;
using I64Array = py::array_t<int64_t, py::array::c_style>;
using F64Array = py::array_t<double, py::array::c_style>;
using U8Array = py::array_t<uint8_t, py::array::c_style>;

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

trees::DraftScores draft_view(const F32Array& values, const std::optional<I32Array>& ids,
                              int64_t vocab_size, const std::optional<I64Array>& max_depths) {
  if (values.ndim() != 3) {
    throw py::value_error("draft scores must be 3-D [B, D, V or K], got shape " + shape_str(values));
  }
  trees::DraftScores in;
  in.values = values.data();
  in.batch = values.shape(0);
  in.positions = values.shape(1);
  in.width = values.shape(2);
  if (in.positions < 1 || in.width < 1) {
    throw py::value_error("draft scores need D >= 1 positions and at least one candidate, got shape " +
                          shape_str(values));
  }
  if (ids) {
    if (ids->ndim() != 3 || ids->shape(0) != in.batch || ids->shape(1) != in.positions ||
        ids->shape(2) != in.width) {
      throw py::value_error("topk_ids shape " + shape_str(*ids) + " differs from topk_values shape " +
                            shape_str(values));
    }
    in.ids = ids->data();
    in.vocab_size = vocab_size;
  } else {
    in.vocab_size = in.width;
  }
  if (max_depths) {
    if (max_depths->ndim() != 1 || max_depths->shape(0) != in.batch) {
      throw py::value_error("max_depths must hold one entry per sequence");
    }
    in.max_depths = max_depths->data();
  }
  return in;
}

trees::Contexts context_view(const std::optional<I32Array>& tokens,
                             const std::optional<I64Array>& offsets, int64_t batch) {
  trees::Contexts ctx;
  if (!offsets) return ctx;
  if (!tokens || tokens->ndim() != 1 || offsets->ndim() != 1 || offsets->shape(0) != batch + 1) {
    throw py::value_error("contexts: need 1-D tokens and B + 1 offsets");
  }
  const int64_t* off = offsets->data();
  if (off[0] != 0 || off[batch] != tokens->shape(0)) throw py::value_error("contexts: bad offsets");
  for (int64_t b = 0; b < batch; ++b) {
    if (off[b + 1] < off[b]) throw py::value_error("contexts: offsets must not decrease");
  }
  ctx.tokens = tokens->data();
  ctx.offsets = off;
  return ctx;
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::tuple to_python(const trees::TreeBatch& batch) {
  return py::make_tuple(to_array(batch.tokens), to_array(batch.parents), to_array(batch.depths),
                        to_array(batch.scores), to_array(batch.offsets));
}

trees::TreeView tree_view(const char* name, const I32Array& tokens, const I32Array& parents,
                          const std::optional<F64Array>& scores,
                          const std::optional<U8Array>& sources) {
  const py::ssize_t n = tokens.ndim() == 1 ? tokens.shape(0) : -1;
  const bool ok = n >= 0 && parents.ndim() == 1 && parents.shape(0) == n &&
                  (!scores || (scores->ndim() == 1 && scores->shape(0) == n)) &&
                  (!sources || (sources->ndim() == 1 && sources->shape(0) == n));
  if (!ok) {
    throw py::value_error(std::string(name) +
                          ": tokens, parents, scores and sources must be 1-D, of one length");
  }
  trees::TreeView view;
  view.tokens = tokens.data();
  view.parents = parents.data();
  view.scores = scores ? scores->data() : nullptr;
  view.sources = sources ? sources->data() : nullptr;
  view.size = n;
  return view;
}

std::vector<int32_t> to_vector(const I32Array& a) {
  return std::vector<int32_t>(a.data(), a.data() + a.size());
}

}  // namespace

void bind_trees(py::module_& m) {
  // The DART parameters with their one set of defaults (trees.h); trees.TreeParams reads
  // its defaults from a default-constructed instance and fills one per call.
  py::class_<trees::DartParams>(m, "DartParams")
      .def(py::init<>())
      .def_readwrite("top_k", &trees::DartParams::top_k)
      .def_readwrite("beam_width", &trees::DartParams::beam_width)
      .def_readwrite("budget", &trees::DartParams::budget)
      .def_readwrite("depth_decay", &trees::DartParams::depth_decay)
      .def_readwrite("draft_decay", &trees::DartParams::draft_decay)
      .def_readwrite("ngram_weight", &trees::DartParams::ngram_weight)
      .def_readwrite("keep_pruned", &trees::DartParams::keep_pruned)
      .def_readwrite("ngram_first_level", &trees::DartParams::ngram_first_level)
      .def_readwrite("prune", &trees::DartParams::prune);

  m.def(
      "_build_dart",
      [](const F32Array& values, const std::optional<I32Array>& ids, int64_t vocab_size,
         const std::optional<I32Array>& ctx_tokens, const std::optional<I64Array>& ctx_offsets,
         const ngram::NgramScorer* scorer, const I32Array& eos_ids,
         const std::optional<I64Array>& max_depths, const trees::DartParams& params) {
        const trees::DraftScores in = draft_view(values, ids, vocab_size, max_depths);
        const trees::Contexts contexts = context_view(ctx_tokens, ctx_offsets, in.batch);
        const trees::EosSet eos(to_vector(eos_ids));
        trees::TreeBatch out;
        {
          py::gil_scoped_release release;
          trees::build_dart(in, contexts, scorer, params, eos, out);
        }
        return to_python(out);
      },
      py::arg("values"), py::arg("ids").none(true), py::arg("vocab_size"),
      py::arg("ctx_tokens").none(true), py::arg("ctx_offsets").none(true),
      py::arg("scorer").none(true), py::arg("eos_ids"), py::arg("max_depths").none(true),
      py::arg("params"),
      "DART n-gram beam search over a batch -> (tokens, parents, depths, scores, offsets).");

  m.def(
      "_build_ddtree",
      [](const F32Array& values, const std::optional<I32Array>& ids, int64_t vocab_size,
         const I32Array& eos_ids, const std::optional<I64Array>& max_depths, int64_t top_k,
         int64_t budget, bool values_are_logprobs) {
        const trees::DraftScores in = draft_view(values, ids, vocab_size, max_depths);
        trees::BestFirstParams params;
        params.top_k = top_k;
        params.budget = budget;
        params.values_are_logprobs = values_are_logprobs;
        const trees::EosSet eos(to_vector(eos_ids));
        trees::TreeBatch out;
        {
          py::gil_scoped_release release;
          trees::build_ddtree(in, params, eos, out);
        }
        return to_python(out);
      },
      py::arg("values"), py::arg("ids").none(true), py::arg("vocab_size"), py::arg("eos_ids"),
      py::arg("max_depths").none(true), py::arg("top_k"), py::arg("budget"),
      py::arg("values_are_logprobs"),
      "DDTree best-first trees over a batch -> (tokens, parents, depths, scores, offsets).");

  m.def(
      "_build_chain",
      [](const F32Array& values, const std::optional<I32Array>& ids, int64_t vocab_size,
         const I32Array& eos_ids, const std::optional<I64Array>& max_depths, int64_t budget,
         bool values_are_logprobs) {
        const trees::DraftScores in = draft_view(values, ids, vocab_size, max_depths);
        trees::BestFirstParams params;
        params.budget = budget;
        params.values_are_logprobs = values_are_logprobs;
        const trees::EosSet eos(to_vector(eos_ids));
        trees::TreeBatch out;
        {
          py::gil_scoped_release release;
          trees::build_chain(in, params, eos, out);
        }
        return to_python(out);
      },
      py::arg("values"), py::arg("ids").none(true), py::arg("vocab_size"), py::arg("eos_ids"),
      py::arg("max_depths").none(true), py::arg("budget"), py::arg("values_are_logprobs"),
      "Top-1 chains over a batch -> (tokens, parents, depths, scores, offsets).");

  m.def(
      "_merge_trees",
      [](const I32Array& tokens1, const I32Array& parents1, const std::optional<F64Array>& scores1,
         const std::optional<U8Array>& sources1, const I32Array& tokens2, const I32Array& parents2,
         const std::optional<F64Array>& scores2, const std::optional<U8Array>& sources2,
         int64_t budget) {
        const trees::TreeView first = tree_view("first", tokens1, parents1, scores1, sources1);
        const trees::TreeView second = tree_view("second", tokens2, parents2, scores2, sources2);
        thread_local trees::MergeScratch scratch;
        {
          py::gil_scoped_release release;
          trees::merge_trees(first, second, budget, scratch);
        }
        const trees::TreeBatch& out = scratch.out;
        return py::make_tuple(to_array(out.tokens), to_array(out.parents), to_array(out.depths),
                              to_array(out.scores), to_array(scratch.sources));
      },
      py::arg("tokens1"), py::arg("parents1"), py::arg("scores1").none(true),
      py::arg("sources1").none(true), py::arg("tokens2"), py::arg("parents2"),
      py::arg("scores2").none(true), py::arg("sources2").none(true), py::arg("budget"),
      "Two trees of one root merged as tries, the best `budget` nodes kept, canonical order -> "
      "(tokens, parents, depths, scores, sources).");

  m.def(
      "_ngram_probs",
      [](const ngram::NgramScorer& scorer, const I32Array& context, const I32Array& candidates) {
        if (context.ndim() != 1 || candidates.ndim() != 1) {
          throw py::value_error("context and candidates must be 1-D");
        }
        py::array_t<float> out(candidates.shape(0));
        const int32_t* ctx = context.data();
        const int32_t* cand = candidates.data();
        float* probs = out.mutable_data();
        const size_t ctx_len = static_cast<size_t>(context.shape(0));
        const size_t n = static_cast<size_t>(candidates.shape(0));
        {
          py::gil_scoped_release release;
          scorer.score(ctx, ctx_len, cand, n, probs);
        }
        return out;
      },
      py::arg("scorer"), py::arg("context"), py::arg("candidates"),
      "The scorer's DART estimate q(t | context) for each candidate (float32).");

  m.def(
      "_scorer_order", [](const ngram::NgramScorer& scorer) { return scorer.order(); },
      py::arg("scorer"), "N-gram order n of a scorer.");

  // TEST SUPPORT ONLY: a scorer over a Python dict {n-gram tuple: count}.
  py::class_<trees::DictScorer, ngram::NgramScorer>(m, "_DictScorer")
      .def(py::init([](int order, const py::dict& counts) {
             std::vector<std::pair<std::vector<int32_t>, uint64_t>> table;
             table.reserve(counts.size());
             for (auto item : counts) {
               table.emplace_back(item.first.cast<std::vector<int32_t>>(),
                                  item.second.cast<uint64_t>());
             }
             return new trees::DictScorer(order, std::move(table));
           }),
           py::arg("order"), py::arg("counts"))
      .def_property_readonly("order", &trees::DictScorer::order);
}
