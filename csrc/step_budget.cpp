#include "step_budget.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "errors.h"

namespace agentaccel {

double StepCost::at(double tokens) const {
  if (base.empty()) return 0.0;
  if (tokens <= 0.0) return base[0];
  const size_t last = base.size() - 1;
  if (tokens >= double(last)) return base[last] + (tokens - double(last)) * tail_slope();
  const size_t i = size_t(tokens);
  const double w = tokens - double(i);
  return base[i] + w * (base[i + 1] - base[i]);
}

void StepCost::validate() const {
  if (base.size() < 2) throw InvalidInput("step cost: base needs the cost of 0 and 1 tokens at least");
  for (size_t i = 0; i < base.size(); ++i) {
    if (!(std::isfinite(base[i]) && base[i] > 0.0)) throw InvalidInput("step cost: every base cost must be > 0");
    if (i > 0 && base[i] < base[i - 1]) throw InvalidInput("step cost: base must not decrease with tokens");
  }
  for (double v : {per_context, per_attention, per_request, prefill_tokens})
    if (!(std::isfinite(v) && v >= 0.0))
      throw InvalidInput("step cost: per_context, per_attention, per_request and prefill_tokens must be finite and >= 0");
  if (!(prefill_share >= 0.0 && prefill_share <= 1.0)) throw InvalidInput("step cost: prefill_share must be in [0, 1]");
}

void StepCost::prepare() {
  min_slope_.assign(base.size(), tail_slope());
  for (size_t i = base.size() - 1; i-- > 0;) min_slope_[i] = std::min(base[i + 1] - base[i], min_slope_[i + 1]);
}

double allocate_budget(const std::vector<BudgetRequest>& requests, size_t decoding, double context, double attention,
                       double rows, const StepCost& cost, std::vector<int32_t>& keep) {
  keep.assign(requests.size(), 0);
  double tokens = double(decoding);
  double work = attention;
  const double fixed = cost.per_context * context + cost.per_request * rows;
  // The prefill a step may carry is computed whatever the drafts: a step saved later saves only
  // its decoding, so the rate a draft token must beat leaves the prefill's time out (its tokens
  // still set where on the curve the drafts' own cost lies).
  const double prefill = cost.expected_prefill(tokens);
  auto seconds = [&](double t, double a) { return cost.expected(t) - prefill + fixed + cost.per_attention * a; };
  double yield = double(decoding);  // tokens the step gives: one per decoding request, plus accepted drafts
  const double t0 = seconds(tokens, work);
  if (!(t0 > 0.0)) return 0.0;
  double best_rate = yield / t0;

  // Nodes are taken by gain per unit of what they add to the step at its starting size (the
  // order); every prefix of that order is priced exactly and the best one is kept.
  const double slope = std::max(cost.expected(tokens + 1.0) - cost.expected(tokens), 0.0);
  const double floor_slope = std::max(cost.expected_min_slope_from(tokens), 0.0);
  double least_context = std::numeric_limits<double>::infinity();
  for (const BudgetRequest& r : requests)
    if (r.size > 0) least_context = std::min(least_context, r.context);
  if (!std::isfinite(least_context)) return best_rate;
  // No node left in the queue can give a better rate than its order key times this: its gain is at
  // most key x (slope + a·c) and it costs at least floor_slope + a·c (a·c smallest at least_context).
  const double least_attention = cost.per_attention * least_context;
  const double bound = slope <= floor_slope ? 1.0
                       : floor_slope + least_attention > 0.0
                           ? (std::max(slope + least_attention, t0 * 1e-9)) / (floor_slope + least_attention)
                           : std::numeric_limits<double>::infinity();
  struct Node {
    double key;
    uint32_t request;
    uint32_t index;
    bool operator<(const Node& o) const { return key < o.key || (key == o.key && request > o.request); }
  };
  // Where tokens cost (almost) nothing the order is by gain alone: every cost is floored at a
  // billionth of the step.
  const double least_adds = t0 * 1e-9;
  auto key_of = [&](const BudgetRequest& r, size_t index) {
    return r.confidence * r.probs[index] / std::max(slope + cost.per_attention * r.context, least_adds);
  };
  thread_local std::vector<Node> queue;  // a max-heap; reused: no allocation per step once warm
  queue.clear();
  for (uint32_t i = 0; i < requests.size(); ++i)
    if (requests[i].size > 0 && requests[i].confidence * requests[i].probs[0] > 0.0)
      queue.push_back(Node{key_of(requests[i], 0), i, 0});
  std::make_heap(queue.begin(), queue.end());

  thread_local std::vector<uint32_t> order;
  order.clear();
  size_t best_count = 0;
  while (!queue.empty()) {
    const Node n = queue.front();
    if (n.key * bound <= best_rate) break;
    std::pop_heap(queue.begin(), queue.end());
    queue.pop_back();
    const BudgetRequest& r = requests[n.request];
    tokens += 1.0;
    work += r.context;
    yield += r.confidence * r.probs[n.index];
    order.push_back(n.request);
    const double rate = yield / seconds(tokens, work);
    if (rate > best_rate) best_rate = rate, best_count = order.size();
    if (n.index + 1 < r.size && r.confidence * r.probs[n.index + 1] > 0.0) {
      queue.push_back(Node{key_of(r, n.index + 1), n.request, n.index + 1});
      std::push_heap(queue.begin(), queue.end());
    }
  }
  for (size_t k = 0; k < best_count; ++k) ++keep[order[k]];
  return best_rate;
}

}  // namespace agentaccel
