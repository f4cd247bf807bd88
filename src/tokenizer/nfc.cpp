#include "tokenizer/nfc.h"

#include <algorithm>
#include <vector>

#include "core/utf8.h"
#include "tokenizer/nfc_data.h"

namespace lathe::tok {

namespace {

constexpr uint32_t SBase = 0xAC00, LBase = 0x1100, VBase = 0x1161, TBase = 0x11A7;
constexpr uint32_t LCount = 19, VCount = 21, TCount = 28, NCount = VCount * TCount, SCount = LCount * NCount;
constexpr uint32_t kInvalidTag = 0x80000000u;  // an invalid byte b is carried as kInvalidTag | b

uint8_t ccc_of(uint32_t cp) {
  if (cp < 0x300 || (cp & kInvalidTag)) return 0;
  const auto* b = std::begin(nfc_data::kCcc);
  const auto* e = std::end(nfc_data::kCcc);
  auto it = std::upper_bound(b, e, cp, [](uint32_t c, const nfc_data::CccRange& r) { return c < r.lo; });
  if (it == b) return 0;
  --it;
  return cp <= it->hi ? it->ccc : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= SBase && cp < SBase + SCount) {
    uint32_t s = cp - SBase;
    out.push_back(LBase + s / NCount);
    out.push_back(VBase + (s % NCount) / TCount);
    if (s % TCount) out.push_back(TBase + s % TCount);
    return;
  }
  if (cp >= 0xC0 && !(cp & kInvalidTag)) {
    const auto* b = std::begin(nfc_data::kDecomp);
    const auto* e = std::end(nfc_data::kDecomp);
    auto it = std::lower_bound(b, e, cp, [](const nfc_data::Decomp& d, uint32_t c) { return d.cp < c; });
    if (it != e && it->cp == cp) {
      decompose(it->a, out);
      if (it->b) decompose(it->b, out);
      return;
    }
  }
  out.push_back(cp);
}

// Composite of (a, b) or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= LBase && a < LBase + LCount && b >= VBase && b < VBase + VCount)
    return SBase + ((a - LBase) * VCount + (b - VBase)) * TCount;
  if (a >= SBase && a < SBase + SCount && (a - SBase) % TCount == 0 && b > TBase && b < TBase + TCount)
    return a + (b - TBase);
  const auto* bg = std::begin(nfc_data::kComp);
  const auto* e = std::end(nfc_data::kComp);
  auto it = std::lower_bound(bg, e, std::pair{a, b}, [](const nfc_data::Comp& c, std::pair<uint32_t, uint32_t> k) {
    return c.a != k.first ? c.a < k.first : c.b < k.second;
  });
  return (it != e && it->a == a && it->b == b) ? it->cp : 0;
}

}  // namespace

void nfc_normalize(std::string& s) {
  bool simple = true;
  for (unsigned char c : s)
    if (c >= 0xCC) {  // lead bytes of U+0300 and above
      simple = false;
      break;
    }
  if (simple) return;
  thread_local std::vector<uint32_t> cps;
  cps.clear();
  for (size_t i = 0; i < s.size();) {
    size_t len = utf8_char_len(s, i);
    if (!utf8_valid_at(s, i)) {
      cps.push_back(kInvalidTag | static_cast<unsigned char>(s[i]));
    } else {
      decompose(utf8_decode(s, i, len), cps);
    }
    i += len;
  }
  // Canonical ordering: stable sort of every run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (ccc_of(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc_of(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j, [](uint32_t a, uint32_t b) { return ccc_of(a) < ccc_of(b); });
    i = j;
  }
  // Canonical composition.
  size_t out = 0;
  long starter = -1;
  int last_ccc = -1;
  for (size_t i = 0; i < cps.size(); ++i) {
    uint32_t c = cps[i];
    int cc = ccc_of(c);
    if (starter >= 0 && !(c & kInvalidTag) && !(cps[starter] & kInvalidTag)) {
      bool blocked = last_ccc != -1 && (last_ccc == 0 || last_ccc >= cc);
      if (!blocked) {
        if (uint32_t comp = compose(cps[starter], c)) {
          cps[starter] = comp;
          continue;  // c consumed; last_ccc unchanged
        }
      }
    }
    if (cc == 0) {
      starter = static_cast<long>(out);
      last_ccc = -1;
    } else {
      last_ccc = cc;
    }
    cps[out++] = c;
  }
  cps.resize(out);
  std::string r;
  r.reserve(s.size());
  for (uint32_t c : cps) {
    if (c & kInvalidTag)
      r += static_cast<char>(c & 0xFF);
    else
      utf8_append(r, c);
  }
  s.swap(r);
}

}  // namespace lathe::tok
