// One draft budget for a whole inference step: given every request's candidate draft and what a
// step of the serving engine costs, keep the drafts' prefixes that give the most tokens per
// second for the batch as a whole (DySpec's greedy expansion, applied across requests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace agentaccel {

// What one step of the serving engine costs, in seconds, as a function of what it schedules:
//   t = base(T) + per_context * C + per_attention * A + per_request * R
// T: tokens the step computes (each decoding request's 1 + draft length, plus prefill chunks);
// C: context tokens of the step's requests (their KV is read once per step, drafts or not);
// A: sum over requests of (1 + draft length) x context (the attention work of their queries);
// R: requests in the step (each costs its own attention and cache bookkeeping, drafts or not).
struct StepCost {
  std::vector<double> base;     // base[T] for T = 0..size-1; beyond, extended with the last slope
  double per_context = 0.0;     // seconds per context token of the batch
  double per_attention = 0.0;   // seconds per (scheduled token x context token)
  double per_request = 0.0;     // seconds per request in the step
  double prefill_tokens = 0.0;  // tokens of a step's prefill chunks, in the steps that carry some
  double prefill_share = 0.0;   // the share of steps that carry prefill (whether the next one will is not known)
  bool in_seconds = true;       // false: a relative seed (1.0 = one plain step), which prices no saved seconds

  bool empty() const { return base.size() < 2; }
  double at(double tokens) const;  // base(T), linear between integer points
  // base at `tokens` decoding tokens, expected over whether the step carries prefill: the mean of
  // the cost, not the cost at the mean (a 2,048-token chunk in one step of ten would otherwise
  // price every step's drafts as if it were compute-bound).
  double expected(double tokens) const {
    return (1.0 - prefill_share) * at(tokens) + prefill_share * at(tokens + prefill_tokens);
  }
  // What a step's prefill adds to it, expected (the budget leaves it out of the rate to beat).
  double expected_prefill(double decoding) const { return expected(decoding) - at(decoding); }
  // A lower bound on what one more token costs from `tokens` on, expected as above.
  double expected_min_slope_from(double tokens) const {
    return (1.0 - prefill_share) * min_slope_from(size_t(tokens)) +
           prefill_share * min_slope_from(size_t(tokens + prefill_tokens));
  }
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
// every draft empty), `rows`: the requests in the step (R: decoding and prefilling). Returns the expected tokens per second of the step chosen, its prefill's
// time left out (the prefill is done whatever the drafts: the rate to beat is decoding's).
double allocate_budget(const std::vector<BudgetRequest>& requests, size_t decoding, double context,
                       double attention, double rows, const StepCost& cost, std::vector<int32_t>& keep);

}  // namespace agentaccel
