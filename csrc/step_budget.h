// One draft budget for a whole inference step: given every request's candidate draft and what a
// step of the serving engine costs, keep the drafts' prefixes that give the most tokens per
// second for the batch as a whole (DySpec's greedy expansion, applied across requests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace agentaccel {

// What one step of the serving engine costs, in seconds, as a function of what it schedules:
//   t = base(T) + per_context * C + per_attention * A
// T: tokens the step computes (each decoding request's 1 + draft length, plus prefill chunks);
// C: context tokens of the step's requests (their KV is read once per step, drafts or not);
// A: sum over requests of (1 + draft length) x context (the attention work of their queries).
struct StepCost {
  std::vector<double> base;     // base[T] for T = 0..size-1; beyond, extended with the last slope
  double per_context = 0.0;     // seconds per context token of the batch
  double per_attention = 0.0;   // seconds per (scheduled token x context token)
  double extra_tokens = 0.0;    // tokens a step schedules beside the decoding requests (prefill), expected

  bool empty() const { return base.size() < 2; }
  double at(double tokens) const;  // base(T), linear between integer points
  // The smallest slope of base from T on (a lower bound on what one more token costs there).
  double min_slope_from(size_t tokens) const { return tokens < min_slope_.size() ? min_slope_[tokens] : tail_slope(); }
  void validate() const;  // throws InvalidInput
  void prepare();         // computes min_slope_ (after base changes)

 private:
  double tail_slope() const { return base.size() < 2 ? 0.0 : base.back() - base[base.size() - 2]; }
  std::vector<double> min_slope_;  // suffix minima of base's slopes
};

// One request of the step, as the budget sees it: its candidate draft's acceptance estimates,
// best node first (every prefix is a valid draft and the estimates do not increase along it).
struct BudgetRequest {
  const double* probs = nullptr;
  size_t size = 0;
  double confidence = 1.0;  // the stage's trust in its estimates: a node gains confidence x D tokens
  double context = 0.0;     // tokens its queries attend over
};

// How many nodes of each request's candidate to keep (`keep`, one entry per request).
// `decoding`: requests that yield a token this step whatever their drafts (drafted for or not),
// `context`: their context tokens (C), `attention`: their attention work without drafts (A with
// every draft empty). Returns the expected tokens per second of the step chosen, its prefill's
// time left out (the prefill is done whatever the drafts: the rate to beat is decoding's).
double allocate_budget(const std::vector<BudgetRequest>& requests, size_t decoding, double context,
                       double attention, const StepCost& cost, std::vector<int32_t>& keep);

}  // namespace agentaccel
