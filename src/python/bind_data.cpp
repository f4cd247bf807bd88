// lathe._lathe.Tokenizer (tokenizer/tokenizer.h: the tokenizers of `lathe encode` and `lathe
// tokenize`) and IndexedDataset (data/indexed_dataset.h: the Megatron .bin/.idx reader of training),
// whose sequences are numpy views of the .bin mmap.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/indexed_dataset.h"
#include "python/bindings.h"
#include "tokenizer/tokenizer.h"

namespace lathe::py {

namespace {

using Ids = nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>;

// A numpy int32 array that owns `v` (moved to the heap; freed with the array).
Ids to_numpy(std::vector<int32_t>&& v) {
  auto* heap = new std::vector<int32_t>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  return Ids(heap->data(), {heap->size()}, owner);
}

// Every text encoded by Tokenizer::encode (const, safe from several threads), spread over
// `workers` threads (0: one per CPU) with the GIL released; the result is in input order.
std::vector<Ids> encode_batch(const tok::Tokenizer& tok, const std::vector<std::string>& texts, int workers) {
  LATHE_CHECK(workers >= 0, "encode_batch: workers = {} must be >= 1 (or None: one per CPU)", workers);
  std::vector<std::vector<int32_t>> ids(texts.size());
  {
    nb::gil_scoped_release release;
    const size_t n = std::max<size_t>(
        1, std::min<size_t>(texts.size(), workers > 0 ? workers : std::max(1u, std::thread::hardware_concurrency())));
    std::vector<std::exception_ptr> errors(n);
    auto work = [&](size_t w) {
      try {
        for (size_t i = w; i < texts.size(); i += n) ids[i] = tok.encode(texts[i]);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    };
    std::vector<std::thread> threads;
    for (size_t w = 1; w < n; ++w) threads.emplace_back(work, w);
    work(0);
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  std::vector<Ids> out;
  out.reserve(ids.size());
  for (auto& v : ids) out.push_back(to_numpy(std::move(v)));
  return out;
}

nb::dlpack::dtype numpy_dtype(DType t, const std::string& prefix) {
  switch (t) {
    case DType::U8:
      return nb::dtype<uint8_t>();
    case DType::U16:
      return nb::dtype<uint16_t>();
    case DType::I32:
      return nb::dtype<int32_t>();
    case DType::I64:
      return nb::dtype<int64_t>();
    default:
      throw_error("{}.idx: token dtype {} has no numpy view", prefix, dtype_name(t));
  }
}

// Sequence i as a read-only numpy view of the .bin mmap (kept alive by `self`).
using View = nb::ndarray<nb::numpy, nb::ro, nb::ndim<1>>;

View sequence_view(nb::handle self, const data::IndexedDataset& ds, int64_t i) {
  const int64_t n = static_cast<int64_t>(ds.num_sequences());
  if (i < 0) i += n;
  if (i < 0 || i >= n) throw nb::index_error(fmt::format("sequence {} out of range (dataset has {})", i, n).c_str());
  const size_t len = static_cast<size_t>(ds.sequence_length(static_cast<size_t>(i)));
  const void* data = ds.sequence_data(static_cast<size_t>(i));
  static const int32_t empty = 0;
  return View(data ? data : &empty, 1, &len, self, nullptr, numpy_dtype(ds.dtype(), ds.prefix()));
}

}  // namespace

void bind_data(nb::module_& m) {
  nb::class_<tok::Tokenizer>(m, "Tokenizer", "A tokenizer (tokenizer/tokenizer.h); use lathe.Tokenizer")
      .def_static(
          "load", [](const std::string& path) { return tok::load_tokenizer(path); }, nb::arg("path"))
      .def(
          "encode", [](const tok::Tokenizer& t, const std::string& s) { return t.encode(s); }, nb::arg("text"))
      .def("encode_batch", &encode_batch, nb::arg("texts"), nb::arg("workers"))
      .def(
          "decode",
          [](const tok::Tokenizer& t, const std::vector<int32_t>& ids) {
            return t.decode(std::span<const int32_t>(ids.data(), ids.size()));
          },
          nb::arg("ids"))
      .def_prop_ro("vocab_size", &tok::Tokenizer::vocab_size)
      .def_prop_ro("eos_id", [](const tok::Tokenizer& t) { return t.eos_id() ? nb::cast(*t.eos_id()) : nb::none(); })
      .def_prop_ro("kind", &tok::Tokenizer::kind);
  nb::class_<data::IndexedDataset>(m, "IndexedDataset", "PREFIX.bin/.idx (data/indexed_dataset.h); use lathe.IndexedDataset")
      .def(nb::init<const std::string&>(), nb::arg("prefix"))
      .def("__len__", &data::IndexedDataset::num_sequences)
      .def(
          "__getitem__",
          [](nb::handle self, int64_t i) { return sequence_view(self, nb::cast<const data::IndexedDataset&>(self), i); },
          nb::arg("i"))
      .def_prop_ro("sizes",
                   [](const data::IndexedDataset& ds) {
                     std::vector<int32_t> v(ds.num_sequences());
                     for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(ds.sequence_length(i));
                     return to_numpy(std::move(v));
                   },
                   nb::rv_policy::automatic)  // a new array (properties default to reference_internal)
      .def_prop_ro("dtype", [](const data::IndexedDataset& ds) { return std::string(dtype_name(ds.dtype())); })
      .def_prop_ro("num_tokens", &data::IndexedDataset::total_tokens)
      .def_prop_ro("prefix", &data::IndexedDataset::prefix);
}

}  // namespace lathe::py
