// Top-k candidate selection per draft position, shared by every tree builder.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "trees.h"

namespace trees {
namespace {

// Candidate order used everywhere: value descending, then id ascending.
inline bool ranks_before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

[[noreturn]] void fail(const char* what, int64_t b, int64_t d, const std::string& detail) {
  throw std::invalid_argument(std::string(what) + "[" + std::to_string(b) + ", " +
                              std::to_string(d) + "] " + detail);
}

// NaN and +inf make every softmax meaningless; -inf (a masked token) is allowed.
inline void check_value(float v, const char* what, int64_t b, int64_t d) {
  if (std::isnan(v)) fail(what, b, d, "contains NaN");
  if (v == std::numeric_limits<float>::infinity()) fail(what, b, d, "contains +inf");
}

// Best `k` of a dense row by a single scan with a heap whose front is the worst kept.
void select_dense_row(const float* row, int64_t width, int64_t k, int64_t b, int64_t d,
                      std::vector<std::pair<float, int32_t>>& heap) {
  heap.clear();
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int64_t i = 0; i < width; ++i) {
    const float v = row[i];
    if (!(v <= kMax)) check_value(v, "logits", b, d);  // only NaN and +inf get here
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(v, static_cast<int32_t>(i));
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    } else if (v > heap.front().first) {  // ids grow, so an equal value never ranks before
      std::pop_heap(heap.begin(), heap.end(), ranks_before);
      heap.back() = {v, static_cast<int32_t>(i)};
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), ranks_before);  // best first
}

// Pre-selected row: validate all K entries, then keep the best k in canonical order.
void select_given_row(const float* values, const int32_t* ids, int64_t width, int64_t k,
                      int64_t vocab_size, int64_t b, int64_t d,
                      std::vector<std::pair<float, int32_t>>& work,
                      std::vector<int32_t>& sorted_ids) {
  work.clear();
  sorted_ids.clear();
  for (int64_t i = 0; i < width; ++i) {
    check_value(values[i], "topk_values", b, d);
    const int32_t id = ids[i];
    if (id < 0 || (vocab_size >= 0 && id >= vocab_size)) {
      fail("topk_ids", b, d,
           "holds token id " + std::to_string(id) + " outside [0, " +
               (vocab_size >= 0 ? std::to_string(vocab_size) : std::string("2^31")) + ")");
    }
    work.emplace_back(values[i], id);
    sorted_ids.push_back(id);
  }
  std::sort(sorted_ids.begin(), sorted_ids.end());
  auto dup = std::adjacent_find(sorted_ids.begin(), sorted_ids.end());
  if (dup != sorted_ids.end()) {
    fail("topk_ids", b, d, "holds token id " + std::to_string(*dup) + " twice");
  }
  if (k == width) {
    std::sort(work.begin(), work.end(), ranks_before);
  } else {
    std::partial_sort(work.begin(), work.begin() + k, work.end(), ranks_before);
    work.resize(k);
  }
}

}  // namespace

void select_candidates(const DraftScores& in, int64_t b, int64_t k, bool need_log_norm,
                       CandidateRows& rows) {
  k = std::min(k, in.width);
  rows.positions = in.positions_of(b);
  rows.k = k;
  rows.ids.resize(rows.positions * k);
  rows.values.resize(rows.positions * k);
  rows.log_norm.assign(rows.positions, 0.0);
  for (int64_t d = 0; d < rows.positions; ++d) {
    const int64_t row_offset = (b * in.positions + d) * in.width;
    const float* values = in.values + row_offset;
    if (in.ids == nullptr) {
      select_dense_row(values, in.width, k, b, d, rows.work);
    } else {
      select_given_row(values, in.ids + row_offset, in.width, k, in.vocab_size, b, d,
                       rows.work, rows.work_ids);
    }
    const double best = rows.work[0].first;
    if (std::isinf(best)) {
      fail(in.ids == nullptr ? "logits" : "topk_values", b, d, "has only -inf values");
    }
    for (int64_t j = 0; j < k; ++j) {
      rows.values[d * k + j] = rows.work[j].first;
      rows.ids[d * k + j] = rows.work[j].second;
    }
    if (!need_log_norm) continue;
    // log-sum-exp, summed in index order (the Python references repeat this exactly).
    double sum = 0.0;
    if (in.ids == nullptr) {
      for (int64_t i = 0; i < in.width; ++i) sum += std::exp(static_cast<double>(values[i]) - best);
    } else {
      for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(rows.work[j].first) - best);
    }
    rows.log_norm[d] = best + std::log(sum);
  }
}

}  // namespace trees
