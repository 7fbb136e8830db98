// Job n-gram: exact counts of every 1..n-gram of a job's finished outputs, as an N-gram scorer
// for DART's beam search, interpolated with the static corpus trie it is built over.
//
// Why: DART's n-gram term re-scores the head's candidates with corpus statistics. A trie built
// over the target's own replies drafts markedly better than one over human ShareGPT text (greedy
// tau +0.15-0.22 at budgets 16-60 on dev prompts, docs/ngram.md), but it cannot ship: it is
// generated data. A nightly job produces exactly that data as it runs, so each worker counts the
// n-grams of the rows it has finished and mixes them into the static trie's estimate:
//
//   q(t | ctx) = (1 - lambda) * q_static(t | ctx) + lambda * q_job(t | ctx),
//   lambda = c / (c + prior),
//
// where q_job follows the NgramScorer contract over the job's counts (longest matching suffix
// first, count(suffix + t) / count(suffix)) and c is the job count of the longest suffix of ctx
// the job has seen (Witten-Bell-like: the more often the job has seen this context, the more its
// own continuation statistics are trusted). With an empty cache lambda = 0 and the scorer is the
// static trie exactly; without a static scorer q = q_job.
//
// Data structure: one open-addressing table (linear probing, load <= 1/2, 32-byte slots) keyed
// by the n-gram's tokens, holding its count; a deque of the live documents. Adding a document
// increments the counts of its n-grams, O(n) per token; once the live documents exceed
// `max_tokens` the oldest are evicted and their counts decremented, so the counts are always
// exactly those of the live documents. Slots whose count fell to zero stay until the next
// rehash, which keeps only live n-grams into a table of at most 6 x (live n-grams + 1) slots:
// memory follows the live tokens (4 B per token for the documents plus at most 192 B per live
// n-gram, of which there are at most n per token and far fewer on repetitive text). Not thread-safe for
// `add`; `score` is const and may run on many threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "ngram_scorer.h"

namespace ngram {

class JobNgram : public NgramScorer {
 public:
  static constexpr int kMaxOrder = 6;

  // `base` (may be null) must outlive this scorer; prior >= 0.
  JobNgram(int order, int64_t max_tokens, const NgramScorer* base, double prior);

  int order() const override { return order_ > base_order_ ? order_ : base_order_; }
  void score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
             float* out_probs) const override;

  // The job's own estimate (no static scorer); returns the count c of the longest suffix of ctx
  // (at most own_order() - 1 tokens) seen in the live documents, 0 when none.
  uint64_t score_job(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
                     float* out_probs) const;

  // One finished document (tokens >= 0, checked by the caller).
  void add(const int32_t* tokens, size_t count);

  // Count of one n-gram (1..own_order() tokens) over the live documents.
  uint64_t count(const int32_t* tokens, size_t len) const;

  int own_order() const { return order_; }
  double prior() const { return prior_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t size() const { return live_tokens_; }
  size_t num_documents() const { return docs_.size(); }
  int64_t evicted_documents() const { return evicted_; }
  size_t distinct_ngrams() const { return live_slots_; }
  size_t memory_bytes() const;

 private:
  struct Slot {
    std::array<int32_t, kMaxOrder> tokens;  // the n-gram, padded with -1
    uint32_t len = 0;                       // 0 = empty slot
    uint32_t count = 0;                     // 0 = evicted (dead until the next rehash)
  };

  size_t find(const int32_t* tokens, size_t len) const;  // slot index, or table size when absent
  void bump(const int32_t* tokens, size_t len, int delta);
  void count_document(const std::vector<int32_t>& doc, int delta);
  void rehash(size_t min_capacity);

  int order_;
  int base_order_;
  int64_t max_tokens_;
  const NgramScorer* base_;
  double prior_;
  std::vector<Slot> table_;
  size_t used_slots_ = 0;  // non-empty slots (live or dead)
  size_t live_slots_ = 0;  // slots with count > 0
  std::deque<std::vector<int32_t>> docs_;
  size_t live_tokens_ = 0;
  int64_t evicted_ = 0;
};

}  // namespace ngram
