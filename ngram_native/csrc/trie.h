// The N-gram trie file: one flat, versioned, checksummed, memory-mappable file.
//
// Why this layout: a worker process maps the file read-only and queries it in place, so
// opening costs O(1) whatever the size, and every process on a node shares the same page
// cache pages. There are no pointers and no per-node objects: each level of the trie is a
// set of parallel arrays (CSR), and a node is just an index into its level.
//
// ---------------------------------------------------------------------------------------
// File layout, format version 1 (all integers little-endian; see docs/trie_format.md)
//
//   offset 0    FileHeader (512 bytes, below)
//   offset 512  payload: for each level k = 0..n, in this order, each section starting
//               at a multiple of 8 bytes and zero-padded to a multiple of 8 bytes:
//                 tokens[k]         u32 x N_k           (absent for level 0)
//                 counts[k]         W_k x N_k           W_k = count_width (4 or 8 bytes)
//                 child_offsets[k]  V_k x (N_k + 1)     V_k = child_offset_width (4 or 8);
//                                                       absent for the last level n
//               then the root index: u32 x (2^k + 1), k = root_index_bits
//
// Level 0 is the root: N_0 = 1, counts[0][0] = total number of tokens in the corpus.
// Level k (1 <= k <= n) holds every stored k-gram, sorted lexicographically; node i of
// level k has the k-gram (parent's (k-1)-gram) + tokens[k][i] and the number of times it
// occurs inside a document, counts[k][i]. Its children are the level-(k+1) nodes
// child_offsets[k][i] .. child_offsets[k][i+1] - 1, sorted by token id (strictly increasing).
// Counts are exact 64-bit counts; a level stores them in 4 bytes when its largest count
// fits, else 8. Child offsets are 4 bytes when N_{k+1} fits in u32, else 8.
// So a leaf costs 8 bytes and an inner node 12 bytes (plus < 8 bytes padding per section).
//
// Root index: the root has up to vocab_size children, too many to binary-search on every
// query, so level 1 is also bucketed by the high bits of the token id. With
// s = bit_width(vocab_size - 1) and k = min(s, bit_width(N_1)) (so about 1-2 level-1 nodes
// per bucket, at most 8 bytes per level-1 node), root_index[b] is the number of level-1
// tokens t with (t >> (s - k)) < b, for b = 0..2^k; token t is then found among level-1
// nodes root_index[t >> (s - k)] .. root_index[(t >> (s - k)) + 1] - 1.
//
// Invariants (checked by NgramTrie::verify): child_offsets[k] starts at 0, ends at N_{k+1}
// and never decreases; sibling tokens strictly increase and are < vocab_size; every count
// of levels >= 1 is >= 1; a node's count >= the sum of its children's counts; the root
// index puts every level-1 node in its token's bucket.
//
// Integrity: header_checksum (XXH64, seed 0, of the 512 header bytes with that field set to
// zero) is checked on every open; payload_checksum (XXH64, seed 0, of bytes
// [512, file_size)) only by a verifying open or verify(). Every section offset and size is
// checked against the real file size on every open, and queries clamp child ranges (and
// root buckets) to their level, so a truncated or altered file can never make a query read
// out of bounds.
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ngram_scorer.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the trie file is little-endian and is mapped in place: only little-endian hosts are supported"
#endif

namespace ngram {

// ----- format constants -----------------------------------------------------------------

inline constexpr char kTrieMagic[8] = {'D', 'A', 'R', 'T', 'T', 'R', 'I', 'E'};
inline constexpr uint32_t kTrieFormatVersion = 1;
inline constexpr uint32_t kByteOrderMark = 0x01020304u;  // reads 0x04030201 if byte-swapped
inline constexpr int kMaxOrder = 8;
inline constexpr size_t kHeaderSize = 512;
inline constexpr size_t kFingerprintSize = 64;  // e.g. a SHA-256 as 64 hex characters

struct LevelEntry {  // 40 bytes
  uint64_t node_count;
  uint64_t tokens_offset;         // 0 for level 0 (no tokens)
  uint64_t counts_offset;
  uint64_t child_offsets_offset;  // 0 for the last level (no children)
  uint8_t count_width;            // 4 or 8
  uint8_t child_offset_width;     // 4 or 8; 0 for the last level
  uint8_t reserved[6];            // zero
};
static_assert(sizeof(LevelEntry) == 40, "LevelEntry must be 40 bytes");

struct FileHeader {  // 512 bytes at offset 0
  char magic[8];                  // "DARTTRIE"
  uint32_t format_version;        // kTrieFormatVersion
  uint32_t byte_order_mark;       // kByteOrderMark
  uint32_t order;                 // n, 1..kMaxOrder
  uint32_t vocab_size;            // token ids are < vocab_size
  uint32_t header_size;           // kHeaderSize
  uint32_t reserved0;             // zero
  uint64_t file_size;             // total bytes, header included
  uint64_t payload_checksum;      // XXH64 of bytes [header_size, file_size)
  uint64_t header_checksum;       // XXH64 of the header with this field zeroed
  uint64_t min_count;             // pruning threshold used to build (0 = unknown, imported)
  uint64_t num_documents;         // documents counted (0 when imported)
  char tokenizer_fingerprint[kFingerprintSize];  // printable ASCII, NUL-padded
  LevelEntry levels[kMaxOrder + 1];              // levels 0..order used, the rest zero
  uint64_t root_index_offset;                    // the root index section (see above)
  uint8_t root_index_bits;                       // k: the root index has 2^k + 1 entries
  uint8_t reserved1[7];                          // zero
};
static_assert(sizeof(FileHeader) == kHeaderSize, "FileHeader must be 512 bytes");

// ----- errors (bound to Python exceptions in bind_trie.cpp) ------------------------------

// The file is not a valid trie of this format: wrong magic/version, truncated, altered.
struct TrieFormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The trie was built for another tokenizer than the caller expects.
struct TokenizerMismatchError : TrieFormatError {
  using TrieFormatError::TrieFormatError;
};
// A query on a trie after close().
struct TrieClosedError : std::logic_error {
  using std::logic_error::logic_error;
};
// An operating-system error (open, read, write, mmap, rename) on `path`.
struct TrieIOError : std::runtime_error {
  TrieIOError(int err, std::string path, const std::string& action)
      : std::runtime_error(action + " '" + path + "': " + std::strerror(err)),
        errno_value(err), action(action), path(std::move(path)) {}
  int errno_value;
  std::string action;  // e.g. "cannot open"
  std::string path;
};

// ----- checksum ---------------------------------------------------------------------------

// XXH64 (the public xxHash 64-bit algorithm), implemented here; streaming so the writer can
// hash the payload while writing it.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  uint64_t acc_[4];
  uint64_t seed_;
  uint64_t total_len_ = 0;
  unsigned char buf_[32];
  size_t buf_len_ = 0;
};
uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

// ----- reader -----------------------------------------------------------------------------

// Validates a trie header without mapping the file. `data` holds the file's first
// min(file_size, kHeaderSize) bytes (more are ignored; fewer: std::invalid_argument) and
// `file_size` is the file's real size. Checks all that an open checks in O(1): magic,
// version, byte order, header checksum, file size, order, widths, reserved fields, and every
// section's offset and bounds. Throws TrieFormatError naming `path` (nothing when empty).
// The one header parser: NgramTrie's constructor and ngram_native.read_trie_header use it.
FileHeader read_header(const unsigned char* data, size_t data_len, uint64_t file_size, const std::string& path);
// The tokenizer fingerprint stored in a header, without its NUL padding.
std::string stored_fingerprint(const FileHeader& h);
// Nodes per level 0..order, from a header.
std::vector<uint64_t> stored_level_sizes(const FileHeader& h);

// A read-only, memory-mapped trie file implementing the DART N-gram estimate.
// Thread-safe: queries take a shared lock, close() an exclusive one, so a close racing a
// query waits for it instead of unmapping under it; queries after close throw.
class NgramTrie final : public NgramScorer {
 public:
  // Maps `path`. Always validates the header and every section's bounds against the file
  // size (O(1)); with `verify` also checks the payload checksum and structure (O(size)).
  // A non-empty `expected_fingerprint` must equal the stored tokenizer fingerprint.
  NgramTrie(const std::string& path, bool verify, const std::string& expected_fingerprint);
  ~NgramTrie() override;
  NgramTrie(const NgramTrie&) = delete;
  NgramTrie& operator=(const NgramTrie&) = delete;

  int order() const override { return static_cast<int>(header_.order); }
  void score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
             float* out_probs) const override;

  // Occurrences of `ngram` (any length; length 0 = total tokens); 0 when not stored.
  uint64_t count(const int64_t* ngram, size_t len) const;
  // Full check: payload checksum, then every structural invariant. Throws TrieFormatError.
  void verify() const;
  // Unmaps the file; idempotent.
  void close();
  bool closed() const;

  uint32_t vocab_size() const { return header_.vocab_size; }
  std::string tokenizer_fingerprint() const;
  std::vector<uint64_t> level_sizes() const;  // nodes per level 0..order
  uint64_t file_size() const { return header_.file_size; }
  uint64_t min_count() const { return header_.min_count; }
  uint64_t num_documents() const { return header_.num_documents; }
  const std::string& path() const { return path_; }
  int count_width(int level) const { return header_.levels[level].count_width; }

  // Copies of one level's arrays (tests, inspection). child_offsets is empty for level n.
  struct LevelCopy {
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> counts;
    std::vector<uint64_t> child_offsets;
  };
  LevelCopy copy_level(int level) const;

 private:
  struct Level {
    const uint32_t* tokens = nullptr;
    const unsigned char* counts = nullptr;
    const unsigned char* child_offsets = nullptr;
    uint64_t size = 0;
    bool counts_u64 = false;
    bool offsets_u64 = false;
  };

  // Level-1 node range [lo, hi) where token t must be, from the root index.
  void root_bucket(uint32_t t, uint64_t* lo, uint64_t* hi) const;

  uint64_t count_at(int level, uint64_t i) const;
  // Child range of node i of `level` in level + 1, clamped to that level's size.
  void child_range(int level, uint64_t i, uint64_t* lo, uint64_t* hi) const;
  bool find_child(int child_level, uint64_t lo, uint64_t hi, int64_t token, uint64_t* out) const;
  // Scores every candidate still marked unscored (< 0) that is among the children [lo, hi)
  // of a context node with count ctx_count; returns how many it scored.
  size_t score_children(int child_level, uint64_t lo, uint64_t hi, uint64_t ctx_count,
                        const int32_t* candidates, size_t n_candidates, float* out_probs) const;
  template <typename Id>
  bool find_node(const Id* ngram, size_t len, uint64_t* node) const;
  void check_open() const;
  void verify_structure() const;

  std::string path_;
  FileHeader header_{};
  const unsigned char* base_ = nullptr;
  size_t mapped_size_ = 0;
  Level levels_[kMaxOrder + 1];
  const uint32_t* root_index_ = nullptr;  // 2^root_index_bits + 1 entries
  int root_index_shift_ = 0;
  mutable std::shared_mutex mutex_;
};

// ----- builder ----------------------------------------------------------------------------

struct BuildOptions {
  int order = 3;
  uint32_t vocab_size = 0;
  std::string tokenizer_fingerprint;
  uint64_t chunk_tokens = uint64_t{1} << 24;  // positions counted in RAM before a spill
  uint64_t min_count = 1;                     // nodes with a smaller count are dropped
  std::string tmp_dir;                        // for spilled runs and level streams
};

struct BuildStats {
  uint64_t num_documents = 0;
  uint64_t num_tokens = 0;
  uint64_t num_runs = 0;   // sorted chunks (1: all fit in RAM, nothing spilled; 0: no tokens)
  uint64_t file_size = 0;
  std::vector<uint64_t> level_sizes;
};

class KeyCounter;  // trie_builder.cpp

// Counts every k-gram (k <= order) inside each document, with bounded memory: positions
// are packed into sort keys, a chunk of `chunk_tokens` keys is sorted in RAM, spilled as a
// sorted run when more follow, and the runs are k-way merged into the trie file.
class TrieBuilder {
 public:
  explicit TrieBuilder(BuildOptions options);
  ~TrieBuilder();
  TrieBuilder(const TrieBuilder&) = delete;
  TrieBuilder& operator=(const TrieBuilder&) = delete;

  // Rejects the whole document (builder unchanged) if an id is outside [0, vocab_size).
  void add_document(const int64_t* ids, size_t len);
  // Writes the trie to `path` atomically (temporary name, then rename). Once only.
  BuildStats finish(const std::string& path);

  uint64_t num_documents() const { return num_documents_; }
  uint64_t num_tokens() const { return num_tokens_; }

 private:
  BuildOptions options_;
  std::unique_ptr<KeyCounter> counter_;
  uint64_t num_documents_ = 0;
  uint64_t num_tokens_ = 0;
  bool finished_ = false;
};

// Converts a trie file of upstream DART's C++ format (see upstream_import.cpp) into ours,
// validating every index, parent/child link and count.
BuildStats import_upstream_trie(const std::string& src_path, const std::string& dst_path,
                                uint32_t vocab_size, const std::string& tokenizer_fingerprint,
                                const std::string& tmp_dir);

// Root index geometry: bits k and shift s - k for a vocabulary and a level-1 size.
int root_index_bits(uint32_t vocab_size, uint64_t level1_size);
int root_index_shift(uint32_t vocab_size, uint64_t level1_size);

// Throws std::invalid_argument unless `fp` is at most 64 printable ASCII characters.
void check_fingerprint(const std::string& fp);

}  // namespace ngram
