// Final-logit soft-capping of the logits the model returns (forward_logits, generation, the KV
// cache): the fused lm-head loss kernels cap their own logits (kernels/cpu/lm_head_loss.cpp); the
// logits paths copy fp32 logits to the host, where the same formula is applied (Gemma 2).
#include <cmath>

#include "models/model.h"

namespace lathe {

void apply_final_softcap(const ModelConfig& cfg, float* logits, int64_t n) {
  const float cap = cfg.final_softcap();
  if (!(cap > 0.0f)) return;
  for (int64_t i = 0; i < n; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
}

}  // namespace lathe
