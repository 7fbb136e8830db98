// DART n-gram beam search (arXiv 2601.19278), scoring as in the reference implementation
// (fvliang/DART, tree_search/cpplib/cpp_search/searcher.cpp built with
// NO_NGRAM_ON_FIRST_TOKEN): levels indexed from 0, the whole beam expanded with the same
// top-k candidates of its position, EOS children sorted after the others at the beam cut,
// and the tree taken from every scored child of every level (keep_pruned = true).
//
// Differences from the reference, all deliberate: EOS nodes are never expanded (the
// reference expands beam-kept EOS nodes too), ties are broken deterministically, the
// final selection is prefix-closed by construction (the reference sorts raw scores, and a
// child may outscore its parent by ~1e-10 because ln(1 + 1e-10) > 0), and children that
// provably cannot enter the tree are skipped (exact; see `prune` below).
#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "trees.h"

namespace trees {
namespace {

constexpr double kLogFloor = 1e-10;  // ln(x + 1e-10): the reference's guard against ln(0)

struct PoolNode {
  int32_t token;
  int32_t parent;  // pool index, -1 = root
  int32_t depth;
  bool eos;
  bool kept;       // survived the beam cut of its level (and so was expanded unless EOS)
  double score;
  double key;      // min(score, parent's key): never increases along a path
};

// Everything one sequence needs; one per thread, reused across sequences and calls.
struct DartWorkspace {
  CandidateRows rows;
  std::vector<double> draft_term;  // [positions * k]: ln(softmax over the k + 1e-10)
  std::vector<PoolNode> pool;      // every scored node, in creation order
  std::vector<int32_t> beam;       // pool indices, best first
  std::vector<int32_t> level;      // pool indices created at the current level
  std::vector<int32_t> context;    // [n - 1]
  std::vector<float> q;            // [k]: n-gram probabilities of one expansion
  std::vector<int32_t> eligible;   // pool indices that may enter the tree
  std::vector<int32_t> local_index;
  std::vector<RawNode> nodes;
  CanonicalScratch canonical;
  double log_floor = 0.0;          // ln(0 + 1e-10), the n-gram term of an unseen token
  double log_one = 0.0;            // ln(1 + 1e-10), the best possible n-gram term
  std::vector<double> best_keys;   // min-heap: the `budget` best eligible keys so far
};

void compute_draft_terms(const CandidateRows& rows, std::vector<double>& term) {
  const int64_t k = rows.k;
  term.resize(rows.positions * k);
  for (int64_t d = 0; d < rows.positions; ++d) {
    const float* v = &rows.values[d * k];
    double* t = &term[d * k];
    const double best = v[0];  // rows are sorted, so this is the maximum
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      t[j] = std::exp(static_cast<double>(v[j]) - best);
      sum += t[j];
    }
    for (int64_t j = 0; j < k; ++j) t[j] = std::log(t[j] / sum + kLogFloor);
  }
}

// The n-gram context of a child of pool node `parent`: the last `width` tokens of
// (committed context + path to the parent, parent included). Returns its length and sets
// `begin` to its first token inside ws.context.
int64_t build_context(const DartWorkspace& ws, int32_t parent, const int32_t* committed,
                      int64_t committed_len, int64_t width, std::vector<int32_t>& buf,
                      const int32_t** begin) {
  int64_t pos = width;
  for (int32_t x = parent; pos > 0 && x >= 0; x = ws.pool[x].parent) buf[--pos] = ws.pool[x].token;
  const int64_t take = std::min(pos, committed_len);
  std::copy(committed + committed_len - take, committed + committed_len, buf.begin() + (pos - take));
  pos -= take;
  *begin = buf.data() + pos;
  return width - pos;
}

void build_one(const DraftScores& in, int64_t b, const Contexts& contexts,
               const ngram::NgramScorer* scorer, const DartParams& p, const EosSet& eos,
               DartWorkspace& ws, TreeBatch& out) {
  select_candidates(in, b, p.top_k, /*need_log_norm=*/false, ws.rows);
  compute_draft_terms(ws.rows, ws.draft_term);
  const int64_t k = ws.rows.k;
  const bool use_ngram = scorer != nullptr && p.ngram_weight != 0.0;
  const int64_t ctx_width = use_ngram ? std::max(0, scorer->order() - 1) : 0;
  ws.context.resize(ctx_width);
  ws.q.resize(k);
  ws.best_keys.reserve(p.budget < 4096 ? p.budget : 4096);
  const int32_t* committed = nullptr;
  int64_t committed_len = 0;
  if (contexts.offsets != nullptr) {
    committed = contexts.tokens + contexts.offsets[b];
    committed_len = contexts.offsets[b + 1] - contexts.offsets[b];
  }

  auto beam_before = [&](int32_t x, int32_t y) {
    const PoolNode& a = ws.pool[x];
    const PoolNode& c = ws.pool[y];
    if (a.eos != c.eos) return c.eos;  // EOS-ending candidates sort after the others
    if (a.score != c.score) return a.score > c.score;
    return x < y;
  };

  // Pruning (exact, see DartParams::prune): `threshold()` is the budget-th best key among
  // the eligible nodes created so far, a lower bound of the final selection's cut-off.
  // A child whose key cannot exceed it is never created: at least `budget` earlier-created
  // nodes rank before it (ties go to creation order), and before its descendants (keys
  // never increase along a path). The beam slot it would take only matters to nodes that
  // rank even lower (or, via EOS ordering, to `kept` flags: hence no pruning when
  // keep_pruned is off and EOS ids are set).
  const bool prune = p.prune && (p.keep_pruned || eos.empty());
  ws.best_keys.clear();
  auto threshold = [&]() {
    if (p.budget == 0) return HUGE_VAL;
    if (static_cast<int64_t>(ws.best_keys.size()) < p.budget) return -HUGE_VAL;
    return ws.best_keys.front();
  };
  auto note_eligible = [&](double key) {
    if (!prune || p.budget == 0) return;
    if (static_cast<int64_t>(ws.best_keys.size()) < p.budget) {
      ws.best_keys.push_back(key);
      std::push_heap(ws.best_keys.begin(), ws.best_keys.end(), std::greater<double>());
    } else if (key > ws.best_keys.front()) {
      std::pop_heap(ws.best_keys.begin(), ws.best_keys.end(), std::greater<double>());
      ws.best_keys.back() = key;
      std::push_heap(ws.best_keys.begin(), ws.best_keys.end(), std::greater<double>());
    }
  };

  ws.pool.clear();
  ws.beam.clear();
  for (int64_t l = 0; l < ws.rows.positions; ++l) {
    const double level_weight = std::pow(static_cast<double>(l + 1), -p.depth_decay);
    const double draft_weight = std::pow(p.draft_decay, static_cast<double>(l));
    if (!std::isfinite(level_weight) || !std::isfinite(draft_weight)) {
      throw std::invalid_argument("depth_decay / draft_decay overflow the level weights at depth " +
                                  std::to_string(l + 1));
    }
    const int32_t* cand = &ws.rows.ids[l * k];
    const double* draft_term = &ws.draft_term[l * k];
    const bool with_ngram = use_ngram && (l > 0 || p.ngram_first_level);  // reference: not at level 0
    // Best possible n-gram term (q = 1): with it, `upper` bounds every child's exact score;
    // all operations are monotone, so the bound also holds in floating point.
    const double ngram_best = with_ngram ? p.ngram_weight * ws.log_one : 0.0;
    ws.level.clear();
    auto expand = [&](int32_t parent) {
      const double parent_score = parent < 0 ? 0.0 : ws.pool[parent].score;
      const double parent_key = parent < 0 ? HUGE_VAL : ws.pool[parent].key;
      // Candidates come by draft term descending, so the ones worth creating are a prefix.
      int64_t count = k;
      if (prune) {
        const double cut = threshold();
        count = 0;
        while (count < k) {
          const double upper = parent_score + level_weight * (draft_weight * draft_term[count] + ngram_best);
          if (std::min(upper, parent_key) <= cut) break;
          ++count;
        }
        if (count == 0) return;
      }
      if (with_ngram) {
        const int32_t* ctx = nullptr;
        const int64_t ctx_len = build_context(ws, parent, committed, committed_len, ctx_width, ws.context, &ctx);
        scorer->score(ctx, static_cast<size_t>(ctx_len), cand, static_cast<size_t>(count), ws.q.data());
        for (int64_t j = 0; j < count; ++j) {
          if (!(ws.q[j] >= 0.0f && ws.q[j] <= 1.0f)) {
            throw std::runtime_error("n-gram scorer returned probability " + std::to_string(ws.q[j]) +
                                     " outside [0, 1]");
          }
        }
      }
      for (int64_t j = 0; j < count; ++j) {
        double term = draft_weight * draft_term[j];
        if (with_ngram) {
          const double q = ws.q[j];
          term += p.ngram_weight * (q == 0.0 ? ws.log_floor : std::log(q + kLogFloor));
        }
        const double score = parent_score + level_weight * term;
        const double key = std::min(score, parent_key);
        ws.level.push_back(static_cast<int32_t>(ws.pool.size()));
        ws.pool.push_back(PoolNode{cand[j], parent, static_cast<int32_t>(l + 1), eos.contains(cand[j]), false,
                                   score, key});
        if (p.keep_pruned) note_eligible(key);
      }
    };
    if (l == 0) {
      expand(-1);
    } else {
      for (int32_t parent : ws.beam) {
        if (!ws.pool[parent].eos) expand(parent);
      }
    }
    if (ws.level.empty()) break;  // every beam node was EOS (or nothing can enter the tree)
    const size_t keep = std::min(static_cast<size_t>(p.beam_width), ws.level.size());
    std::partial_sort(ws.level.begin(), ws.level.begin() + keep, ws.level.end(), beam_before);
    ws.beam.assign(ws.level.begin(), ws.level.begin() + keep);
    for (int32_t x : ws.beam) {
      ws.pool[x].kept = true;
      if (!p.keep_pruned) note_eligible(ws.pool[x].key);
    }
  }

  // Final selection: best `budget` by (key desc, creation order asc), a total order in
  // which every parent precedes its children, so any top set is prefix-closed.
  ws.eligible.clear();
  for (int32_t x = 0; x < static_cast<int32_t>(ws.pool.size()); ++x) {
    if (p.keep_pruned || ws.pool[x].kept) ws.eligible.push_back(x);
  }
  const size_t n = std::min(static_cast<size_t>(p.budget), ws.eligible.size());
  std::nth_element(ws.eligible.begin(), ws.eligible.begin() + n, ws.eligible.end(),
                   [&](int32_t x, int32_t y) {
                     if (ws.pool[x].key != ws.pool[y].key) return ws.pool[x].key > ws.pool[y].key;
                     return x < y;
                   });
  std::sort(ws.eligible.begin(), ws.eligible.begin() + n);  // creation order is topological
  ws.local_index.assign(ws.pool.size(), -1);
  ws.nodes.clear();
  for (size_t i = 0; i < n; ++i) {
    const PoolNode& node = ws.pool[ws.eligible[i]];
    int32_t parent = -1;
    if (node.parent >= 0) {
      parent = ws.local_index[node.parent];
      if (parent < 0) throw std::logic_error("DART tree selection is not prefix-closed");
    }
    ws.local_index[ws.eligible[i]] = static_cast<int32_t>(i);
    ws.nodes.push_back(RawNode{node.token, parent, node.depth, node.score});
  }
  append_canonical(ws.nodes, out, ws.canonical);
}

}  // namespace

void build_dart(const DraftScores& in, const Contexts& contexts,
                const ngram::NgramScorer* scorer, const DartParams& params, const EosSet& eos,
                TreeBatch& out) {
  if (params.top_k < 1 || params.beam_width < 1 || params.budget < 0) {
    throw std::invalid_argument("DART needs top_k >= 1, beam_width >= 1 and budget >= 0");
  }
  // One workspace per thread, kept across calls: after the first tree, building one
  // allocates nothing (a fresh 100+ KB pool per call costs page faults every time).
  thread_local DartWorkspace ws;
  // Computed at run time by the same libm call as ln(q + 1e-10) for q = 0 (no constant
  // folding), so the shortcut in `expand` is bit-identical to the general formula.
  volatile double floor_value = kLogFloor;
  ws.log_floor = std::log(floor_value + 0.0);
  ws.log_one = std::log(floor_value + 1.0);
  // Worst-case pool size: level l creates (beam size) * k nodes, beam size <= beam_width.
  // Saturated arithmetic; beyond kReserveLimit the vectors simply grow on demand.
  constexpr int64_t kReserveLimit = int64_t{1} << 20;
  const int64_t k = std::min(params.top_k, in.width);
  int64_t beam = 1, capacity = 0;
  for (int64_t l = 0; l < in.positions && capacity < kReserveLimit; ++l) {
    capacity += beam * k;
    beam = std::min({params.beam_width, beam * k, kReserveLimit});
  }
  ws.pool.reserve(std::min(capacity, kReserveLimit));
  ws.level.reserve(std::min(beam * k, kReserveLimit));
  ws.beam.reserve(beam);
  for (int64_t b = 0; b < in.batch; ++b) build_one(in, b, contexts, scorer, params, eos, ws, out);
}

}  // namespace trees
