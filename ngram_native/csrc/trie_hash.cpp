// XXH64, written from the public algorithm description (xxHash specification, 64-bit
// variant). Chosen for the payload checksum because it runs at memory speed, so verifying
// a multi-GB trie costs well under a second, and it is easy to cross-check against the
// reference library (tests/test_trie_format.py does, when libxxhash is installed).
#include <cstring>

#include "trie.h"

namespace ngram {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t round_step(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t merge_round(uint64_t acc, uint64_t val) {
  acc ^= round_step(0, val);
  return acc * kP1 + kP4;
}

}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed) {
  acc_[0] = seed + kP1 + kP2;
  acc_[1] = seed + kP2;
  acc_[2] = seed;
  acc_[3] = seed - kP1;
}

void Xxh64::update(const void* data, size_t len) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_len_ += len;
  if (buf_len_ > 0) {  // complete the pending stripe first
    size_t take = 32 - buf_len_ < len ? 32 - buf_len_ : len;
    std::memcpy(buf_ + buf_len_, p, take);
    buf_len_ += take;
    p += take;
    len -= take;
    if (buf_len_ < 32) return;
    for (int i = 0; i < 4; ++i) acc_[i] = round_step(acc_[i], load64(buf_ + 8 * i));
    buf_len_ = 0;
  }
  while (len >= 32) {
    acc_[0] = round_step(acc_[0], load64(p));
    acc_[1] = round_step(acc_[1], load64(p + 8));
    acc_[2] = round_step(acc_[2], load64(p + 16));
    acc_[3] = round_step(acc_[3], load64(p + 24));
    p += 32;
    len -= 32;
  }
  std::memcpy(buf_, p, len);
  buf_len_ = len;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_len_ >= 32) {
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    for (int i = 0; i < 4; ++i) h = merge_round(h, acc_[i]);
  } else {
    h = seed_ + kP5;
  }
  h += total_len_;
  const unsigned char* p = buf_;
  size_t len = buf_len_;
  while (len >= 8) {
    h ^= round_step(0, load64(p));
    h = rotl(h, 27) * kP1 + kP4;
    p += 8;
    len -= 8;
  }
  if (len >= 4) {
    h ^= uint64_t{load32(p)} * kP1;
    h = rotl(h, 23) * kP2 + kP3;
    p += 4;
    len -= 4;
  }
  while (len > 0) {
    h ^= uint64_t{*p} * kP5;
    h = rotl(h, 11) * kP1;
    ++p;
    --len;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  Xxh64 state(seed);
  state.update(data, len);
  return state.digest();
}

}  // namespace ngram
