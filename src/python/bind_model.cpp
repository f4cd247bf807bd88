// lathe._lathe.Model: a model found as `lathe export` finds it (train/model_source.h: checkpoint,
// run or Hugging Face directory); logits as `lathe logits` (Model::forward_logits), the loss as
// `lathe eval` (Model::forward_backward without backward), sampling as `lathe generate`
// (eval/generate.h, with the KV cache).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "core/error.h"
#include "eval/generate.h"
#include "kernels/backend.h"
#include "python/bindings.h"
#include "train/model_source.h"

namespace lathe::py {

namespace {

using IdsIn = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

struct PyModel {
  ModelSource src;
  std::string path;

  Model& model() { return *src.model; }
  // Rows of ids checked against the vocabulary and the positions; activations for alloc_B x T.
  void prepare(const int32_t* ids, int64_t B, int64_t T, const char* what, int64_t alloc_B) {
    const ModelConfig& c = model().config();
    LATHE_CHECK(B >= 1 && T >= 1, "Model.{}: ids has shape [{}, {}]; give at least one row of one token", what, B, T);
    LATHE_CHECK(T <= c.max_position_embeddings,
                "Model.{}: {} tokens per row exceed the model's max_position_embeddings {}", what, T,
                c.max_position_embeddings);
    for (int64_t i = 0; i < B * T; ++i)
      LATHE_CHECK(ids[i] >= 0 && ids[i] < c.vocab_size, "Model.{}: token id {} at row {} position {} outside [0, {})",
                  what, ids[i], i / T, i % T, c.vocab_size);
    if (model().max_batch() < alloc_B || model().max_seq() < T)
      model().allocate(std::max(alloc_B, model().max_batch()), std::max(T, model().max_seq()));
  }
};

// dtype "bf16" / "fp16": the model of a run trained with precision.compute bf16 / fp16 (the same
// op table: activations and weight copies rounded to 16 bits, fp32 accumulation, fp32 logits).
DType compute_dtype_of(const std::string& dtype) {
  if (dtype == "fp32" || dtype == "float32") return DType::F32;
  if (dtype == "bf16" || dtype == "bfloat16") return DType::BF16;
  if (dtype == "fp16" || dtype == "float16") return DType::F16;
  throw_error("Model.from_pretrained: dtype '{}' is not one of fp32, bf16, fp16", dtype);
}

// The fp32 model `src` as a model computing in `dt`: the same config and fp32 masters (copied: the
// tables of one config are laid out alike whatever the dtype), their 16-bit copies rounded from them.
// No gradient buffers (inference only: Model.loss runs the forward pass alone).
std::unique_ptr<Model> in_compute_dtype(std::unique_ptr<Model> src, DType dt) {
  if (dt == DType::F32) return src;
  ComputeSpec cs;
  cs.dtype = dt;
  cs.gradients = false;
  auto m = build_model(src->config(), cs);
  const auto& a = src->params().specs();
  const auto& b = m->params().specs();
  LATHE_CHECK(a.size() == b.size() && m->num_params() == src->num_params(),
              "Model.from_pretrained: the {} model's parameter table differs from the fp32 one's",
              compute_dtype_name(dt));
  for (size_t i = 0; i < a.size(); ++i)
    LATHE_CHECK(a[i].name == b[i].name && a[i].offset == b[i].offset,
                "Model.from_pretrained: tensor {} of the {} model is laid out unlike the fp32 one's", a[i].name,
                compute_dtype_name(dt));
  std::copy(src->param_data(), src->param_data() + src->num_params(), m->param_data());
  m->refresh_compute_weights();
  return m;
}

std::unique_ptr<PyModel> from_pretrained(const std::string& path, const std::string& dtype) {
  const DType dt = compute_dtype_of(dtype);
  auto m = std::make_unique<PyModel>();
  m->src = load_model_source(path, [](const std::string& log) { fmt::print(stderr, "{}", log); });
  m->src.model = in_compute_dtype(std::move(m->src.model), dt);
  m->path = path;
  return m;
}

nb::ndarray<nb::numpy, float, nb::ndim<3>> logits(PyModel& m, IdsIn ids) {
  const int64_t B = static_cast<int64_t>(ids.shape(0)), T = static_cast<int64_t>(ids.shape(1));
  m.prepare(ids.data(), B, T, "logits", 1);
  const int64_t V = m.model().config().vocab_size;
  auto* out = new std::vector<float>(static_cast<size_t>(B * T * V));
  nb::capsule owner(out, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  {
    nb::gil_scoped_release release;
    // One row at a time, as `lathe logits` computes them: a row's logits do not depend on the
    // other rows of the batch (a batched GEMM may round differently), bit for bit.
    for (int64_t b = 0; b < B; ++b) m.model().forward_logits(ids.data() + b * T, 1, T, out->data() + b * T * V);
  }
  return nb::ndarray<nb::numpy, float, nb::ndim<3>>(out->data(), {size_t(B), size_t(T), size_t(V)}, owner);
}

// Mean next-token loss of the rows: position t predicts token t+1 (as `lathe eval` over samples
// of T tokens and their shifted targets).
double loss(PyModel& m, IdsIn ids) {
  const int64_t B = static_cast<int64_t>(ids.shape(0)), T = static_cast<int64_t>(ids.shape(1));
  LATHE_CHECK(T >= 2, "Model.loss: rows of {} token(s); the loss needs at least 2 (inputs and the next token)", T);
  m.prepare(ids.data(), B, T, "loss", B);
  std::vector<int32_t> in(static_cast<size_t>(B * (T - 1))), tgt(in.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t + 1 < T; ++t) {
      in[b * (T - 1) + t] = ids.data()[b * T + t];
      tgt[b * (T - 1) + t] = ids.data()[b * T + t + 1];
    }
  nb::gil_scoped_release release;
  const double sum = m.model().forward_backward(in.data(), tgt.data(), B, T - 1, 1.0f, /*backward=*/false);
  return sum / static_cast<double>(B * (T - 1));
}

std::vector<int32_t> generate(PyModel& m, const std::vector<int32_t>& prompt, int64_t max_new_tokens, float temperature,
                              int64_t top_k, float top_p, uint64_t seed) {
  LATHE_CHECK(!prompt.empty(), "Model.generate: prompt_ids is empty; give at least one token");
  LATHE_CHECK(max_new_tokens >= 1 && max_new_tokens <= (int64_t{1} << 24),
              "Model.generate: max_new_tokens = {} must be in [1, 2^24]", max_new_tokens);
  LATHE_CHECK(temperature >= 0 && temperature <= 100, "Model.generate: temperature = {} must be in [0, 100]",
              temperature);
  LATHE_CHECK(top_k >= 0, "Model.generate: top_k = {} must be >= 0 (0 = all)", top_k);
  LATHE_CHECK(top_p > 0 && top_p <= 1, "Model.generate: top_p = {} must be in (0, 1] (1 = off)", top_p);
  const ModelConfig& c = m.model().config();
  for (size_t i = 0; i < prompt.size(); ++i)
    LATHE_CHECK(prompt[i] >= 0 && prompt[i] < c.vocab_size, "Model.generate: prompt id {} at {} outside [0, {})",
                prompt[i], i, c.vocab_size);
  SamplingOptions so;
  so.max_new_tokens = max_new_tokens;
  so.temperature = temperature;
  so.top_k = top_k;
  so.top_p = top_p;
  so.seed = seed;
  // The window `lathe generate` decodes in (with the KV cache where the model allows it, as there).
  const int64_t window = std::min<int64_t>(c.max_position_embeddings, 1024);
  if (m.model().max_batch() != 1 || m.model().max_seq() != window) m.model().allocate(1, window);
  nb::gil_scoped_release release;
  return lathe::generate(m.model(), prompt, so);
}

}  // namespace

void bind_model(nb::module_& m) {
  nb::class_<PyModel>(m, "Model", "A model (train/model_source.h); use lathe.Model")
      .def_static("from_pretrained", &from_pretrained, nb::arg("path"), nb::arg("dtype"))
      .def("config_json", [](PyModel& p) { return p.model().config().to_hf_json().dump(); })
      .def_prop_ro("source", [](const PyModel& p) { return p.src.desc; })
      .def_prop_ro("dtype", [](PyModel& p) { return compute_dtype_name(p.model().compute_dtype()); })
      .def_prop_ro("tokenizer", [](const PyModel& p) { return p.src.tokenizer; })
      .def_prop_ro("hf_dir", [](const PyModel& p) { return p.src.hf_dir; })
      .def("logits", &logits, nb::arg("ids"))
      .def("loss", &loss, nb::arg("ids"))
      .def("generate", &generate, nb::arg("prompt_ids"), nb::arg("max_new_tokens"), nb::arg("temperature"),
           nb::arg("top_k"), nb::arg("top_p"), nb::arg("seed"));
}

}  // namespace lathe::py
