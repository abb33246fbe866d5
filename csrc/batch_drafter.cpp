#include "batch_drafter.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>

#include "errors.h"

namespace agentaccel {

namespace {
// Below this many drafts a step, waking the pool costs more than it saves.
constexpr size_t kMinParallelJobs = 16;
// Every change of a stage tree makes each live request of that stage re-match its last
// max_depth tokens at its next draft, so the outputs that finished in a step join their trees
// together, at the end of the step: one re-match per step at most. (Holding them back for up to
// 16 steps under load saved a third of the proposer's time at 256 in flight, but the next call
// of a pipeline, which starts as soon as its predecessor's answer is out, then drafted without
// that answer: 4 % fewer tokens per step at 16 in flight, docs/BENCHMARKS.md.) Between steps, a
// request that leaves while few are live joins at once.
constexpr size_t kFewLive = 16;
}  // namespace

double ModelRecord::estimate(size_t depth) const {
  double prior = kPrior;
  for (size_t j = 0; j < depth; ++j) prior *= kPrior;
  const double tries = depth < tried.size() ? double(tried[depth]) : 0.0;
  const double hits = depth < reached.size() ? double(reached[depth]) : 0.0;
  return (hits + kWeight * prior) / (tries + kWeight);
}

void ModelRecord::observe(size_t drafted, size_t accepted) {
  if (tried.size() < drafted) tried.resize(drafted), reached.resize(drafted);
  for (size_t j = 0; j < drafted; ++j) {
    ++tried[j];
    reached[j] += j < accepted;
  }
  if (!tried.empty() && tried[0] >= kHorizon) scale(1, 2);
}

void ModelRecord::pass_over() {
  if (++passed < kFadeAfter) return;
  passed = 0;
  scale(3, 4);
}

void ModelRecord::offer() {
  if (++offered < kColdWindow) return;
  offered /= 2, won /= 2, worth /= 2, spent /= 2;
}

bool ModelRecord::follow_new_request(bool cold) {
  if (!cold) {
    missed_probes = 0;
    return true;
  }
  return cold_starts++ % probe_interval() == 0;
}

void ModelRecord::scale(uint64_t num, uint64_t den) {
  // floor(x * num / den) keeps every order between counts: reached <= tried, deeper <= shallower
  for (size_t j = 0; j < tried.size(); ++j) tried[j] = tried[j] * num / den, reached[j] = reached[j] * num / den;
}

BatchDrafter::BatchDrafter(Engine& engine, int threads) : engine_(engine) {
  if (threads < 1) throw InvalidInput("threads must be at least 1");
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

BatchDrafter::~BatchDrafter() {
  {
    std::lock_guard lock(pool_mu_);
    stopping_ = true;
  }
  pool_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void BatchDrafter::admit(const std::string& rid, const std::string& stage, bool speculate, int64_t max_total_tokens) {
  if (stage.empty()) throw InvalidInput("stage must be a non-empty string");
  std::lock_guard lock(admit_mu_);
  Entry& e = entries_[rid];
  if (e.started) return;  // re-admitted while live (vLLM re-adds a request it moved): keep its state
  e.stage = stage;
  e.speculate = speculate;
  e.max_total_tokens = max_total_tokens;
  e.seen = step_no_;  // the next step must list it, or it is dropped (aborted before its first step)
}

size_t BatchDrafter::tracked() const {
  std::lock_guard lock(admit_mu_);
  return entries_.size();
}

size_t BatchDrafter::pending_outputs() const {
  std::lock_guard lock(admit_mu_);
  return pending_.size();
}

std::vector<std::vector<double>> BatchDrafter::candidate_probs() const {
  std::lock_guard lock(admit_mu_);
  std::vector<std::vector<double>> out(rows_);
  if (budgeted_)
    for (const Job& j : jobs_) out[j.index] = j.candidate.probs;
  return out;
}

std::vector<bool> BatchDrafter::model_rows() const {
  std::lock_guard lock(admit_mu_);
  std::vector<bool> out(rows_, false);
  for (const Job& j : jobs_) out[j.index] = j.use_model;
  return out;
}

std::vector<bool> BatchDrafter::followed_rows() const {
  std::lock_guard lock(admit_mu_);
  return followed_;
}

size_t BatchDrafter::model_passes() const {
  std::lock_guard lock(admit_mu_);
  return last_model_passes_;
}

void BatchDrafter::drafter_ran(uint32_t passes, double seconds) {
  if (!(seconds >= 0.0) || !std::isfinite(seconds)) throw InvalidInput("a drafter's seconds must be finite and >= 0");
  std::lock_guard lock(admit_mu_);
  drafter_passes_ = passes;
  drafter_seconds_ = seconds;
  if (passes) charge_drafter(seconds);  // none: the step's positions wait for the next run (catch_up.py)
}

void BatchDrafter::charge_drafter(double seconds) {
  // The run covered each followed request's positions since its last (a new one's prompt, what the
  // skipped steps held): its time is shared by those positions, each stage charged for its own.
  thread_local std::vector<std::pair<Entry*, double>> covered;
  covered.clear();
  double total = 0.0;
  for (const auto& [rid, tokens] : last_followed_) {
    auto it = entries_.find(rid);
    if (it == entries_.end()) continue;  // released since
    Entry& e = it->second;
    const double positions = double(std::max(tokens - e.written, 0));
    e.written = std::max(e.written, tokens);
    covered.emplace_back(&e, positions);
    total += positions;
  }
  if (total <= 0.0 || last_plain_seconds_ <= 0.0) return;
  const double steps = seconds / last_plain_seconds_;
  std::lock_guard clock(counters_mu_);
  pooled_.spent += steps;
  for (const auto& [e, positions] : covered)
    if (positions > 0.0) record_of(e->stage, /*make=*/true)->spent += steps * positions / total;
}

std::map<std::string, ModelRecord> BatchDrafter::model_records() const {
  std::lock_guard lock(counters_mu_);
  return model_records_;
}

bool BatchDrafter::set_model_record(const std::string& stage, ModelRecord record) {
  if (record.tried.size() != record.reached.size()) throw InvalidInput("a model record needs tried and reached alike");
  for (size_t j = 0; j < record.tried.size(); ++j)
    if (record.reached[j] > record.tried[j] || (j && record.tried[j] > record.tried[j - 1]) ||
        (j && record.reached[j] > record.reached[j - 1]))
      throw InvalidInput("a model record must not reach a depth more often than it tried it or the depth before");
  std::lock_guard lock(counters_mu_);
  auto found = model_records_.find(stage);
  if (found == model_records_.end() && model_records_.size() >= kMaxCountedStages) return false;
  model_records_[stage] = std::move(record);
  return true;
}

ModelRecord* BatchDrafter::record_of(const std::string& stage, bool make) {
  auto found = model_records_.find(stage);
  if (found != model_records_.end()) return &found->second;
  const bool full = model_records_.size() >= kMaxCountedStages;
  if (make) return &model_records_[full ? std::string(kOtherStages) : stage];
  found = full ? model_records_.find(kOtherStages) : model_records_.end();
  return found != model_records_.end() ? &found->second : nullptr;
}

std::map<std::string, StageCounters> BatchDrafter::counters() const {
  std::lock_guard lock(counters_mu_);
  return counters_;
}

std::vector<std::vector<uint32_t>> BatchDrafter::step(const BatchStep& s) {
  const auto started = std::chrono::steady_clock::now();
  const size_t n = s.rids->size();
  std::vector<std::vector<uint32_t>> out(n);
  std::shared_ptr<const StepCost> cost;
  {
    std::lock_guard clock(cost_mu_);
    cost = cost_;
  }
  std::lock_guard lock(admit_mu_);
  ++step_no_;
  jobs_.clear();
  rows_ = n;
  budgeted_ = cost != nullptr;
  StepScan scan = scan_rows(s);
  if (scan.continued) record_timing(scan.timed, started);
  if (cost && cost->in_seconds && !scan.verified->empty()) credit_saved(*cost, scan);
  last_plain_seconds_ = 0.0;  // known only under a step cost in seconds (set_floors)
  if (budgeted_) set_floors(*cost, scan, s.model_tokens != nullptr);
  run_jobs(out);
  if (budgeted_) {
    spend_budget(*cost, scan.decoding, scan.next_context, scan.next_attention, double(scan.listed), out);
    if (s.model_tokens) price_drafter_passes(double(scan.decoding), out);
  }
  note_drafts(out);
  retire_absent();
  last_start_ = started;
  last_end_ = std::chrono::steady_clock::now();
  proposer_ns_.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(last_end_ - started).count()),
                         std::memory_order_relaxed);
  steps_.fetch_add(1, std::memory_order_relaxed);
  timed_before_ = true;
  return out;
}

BatchDrafter::StepScan BatchDrafter::scan_rows(const BatchStep& s) {
  const auto& rids = *s.rids;
  const size_t n = rids.size();
  StepScan scan;
  thread_local std::vector<std::pair<StageCounters*, double>> verified;
  verified.clear();
  scan.verified = &verified;
  std::lock_guard clock(counters_mu_);
  followed_.assign(n, false);
  last_followed_.clear();
  for (size_t i = 0; i < n; ++i) {
    const std::string& rid = rids[i];
    if (rid.empty()) continue;
    Entry& e = entries_[rid];  // never admitted (no stage known): the defaults
    scan.continued |= e.listed != 0 && e.listed + 1 == step_no_;
    if (e.stage.empty()) e.stage = "default";
    // its first step (its prompt's first chunk): followed or not for good
    if (e.listed == 0 && s.model_tokens && drafter_skips_.load(std::memory_order_relaxed)) {
      ModelRecord* own = record_of(e.stage, /*make=*/false);
      const bool cold = stage_cold(own);
      // a stage without a record of its own, cold by the pooled one: a record to count its probes
      if (cold && own == nullptr) own = record_of(e.stage, /*make=*/true);
      if (own != nullptr) e.followed = own->follow_new_request(cold), e.probe = cold && e.followed;
    }
    followed_[i] = e.followed;
    if (e.followed && s.model_tokens) last_followed_.emplace_back(rid, s.num_tokens[i]);
    e.seen = e.listed = step_no_;
    const int64_t lo = s.sampled_offsets[i], hi = s.sampled_offsets[i + 1];
    const int32_t num_tokens = s.num_tokens[i];
    const double before = double(std::max<int64_t>(int64_t(num_tokens) - (hi - lo), 0));  // its context then
    ++scan.timed.requests;
    ++scan.listed;
    scan.timed.context += before;
    scan.next_context += double(std::max(num_tokens, 0));
    if (hi <= lo) continue;  // a partial prefill
    const double queried = 1.0 + double(std::max(e.last_draft, 0));  // the token it fed plus the draft verified
    scan.timed.decode_tokens += queried;
    scan.timed.attention += queried * before;
    scan.drafted_tokens += queried - 1.0;
    scan.drafted_attention += (queried - 1.0) * before;
    ++scan.decoding;
    scan.next_attention += double(std::max(num_tokens, 0));
    if (!e.speculate) continue;  // a baseline request
    if (num_tokens < hi - lo || size_t(num_tokens) > s.stride)
      throw InvalidInput("request " + rid + ": num_tokens out of range");
    if (!e.started) {
      // Everything before this step's tokens: the prompt, and after a preemption also what the
      // request generated before it (vLLM re-adds preempted requests as new ones).
      const int32_t* row = s.rows + i * s.stride;
      static_assert(sizeof(int32_t) == sizeof(uint32_t));
      e.prompt_len = size_t(num_tokens - (hi - lo));
      engine_.start_request(rid, reinterpret_cast<const uint32_t*>(row), e.prompt_len, e.stage);
      e.started = true;
    }
    if (!e.counters) {  // past kMaxCountedStages distinct names the rest share one entry
      auto it = counters_.find(e.stage);
      e.counters = it != counters_.end() ? &it->second
                   : counters_.size() < kMaxCountedStages ? &counters_[e.stage] : &counters_[kOtherStages];
      e.counters->model_unfollowed += !e.followed;
    }
    engine_.extend(rid, reinterpret_cast<const uint32_t*>(s.sampled + lo), size_t(hi - lo));
    e.counters->tokens += uint64_t(hi - lo);
    if (e.last_draft >= 0) verified.emplace_back(e.counters, double(count_verified(e, hi - lo)));
    // A draft of d tokens yields up to d + 1: never more than the model may still give.
    int64_t room = int64_t(s.max_model_len) - num_tokens - 1;
    if (e.max_total_tokens >= 0) room = std::min<int64_t>(room, e.max_total_tokens - num_tokens - 1);
    const int budget = int(std::min<int64_t>(s.max_tokens, room));
    e.last_draft = 0;
    e.last_score = 0.0;
    e.last_model = false;
    if (budget > 0) add_job(s, i, rid, e, budget, double(num_tokens));
  }
  last_decoding_ = scan.decoding;  // after count_verified read the step before's
  scan.timed.tokens = s.scheduled >= 0 ? double(s.scheduled) : scan.timed.decode_tokens;
  // they ran after the last step, before this one's target pass
  scan.timed.drafter_passes = std::exchange(drafter_passes_, 0);
  scan.timed.drafter_seconds = std::exchange(drafter_seconds_, 0.0);
  return scan;
}

int64_t BatchDrafter::count_verified(Entry& e, int64_t sampled) {
  const int64_t accepted = std::min<int64_t>(e.last_draft, sampled - 1);
  StageCounters& c = *e.counters;
  c.steps += 1;
  if (e.last_model) {  // the model's chain: its own counters, and its stage's record learns
    c.model_drafted_steps += 1;
    c.model_drafted += uint64_t(e.last_draft);
    c.model_accepted += uint64_t(accepted);
    c.model_predicted += e.last_score;
    ModelRecord* record = record_of(e.stage, /*make=*/true);
    record->observe(size_t(e.last_draft), size_t(accepted));
    record->won += uint64_t(accepted), pooled_.won += uint64_t(accepted);
    // each token saves its request a step of the batch it was sent in: 1 / its rows decoding of one
    const double worth = double(accepted) / double(std::max<size_t>(last_decoding_, 1));
    record->worth += worth, pooled_.worth += worth;
  } else {
    c.drafted_steps += e.last_draft > 0;
    c.drafted += uint64_t(e.last_draft);
    c.accepted += uint64_t(accepted);
    c.predicted += e.last_score;
  }
  return accepted;
}

void BatchDrafter::add_job(const BatchStep& s, size_t i, const std::string& rid, Entry& e, int budget,
                           double context) {
  jobs_.emplace_back();
  Job& j = jobs_.back();
  j.index = i, j.rid = &rid, j.entry = &e, j.budget = budget, j.context = context;
  if (!s.model_tokens || !e.followed) return;
  // the hybrid: the model's chain, priced by its stage's record
  const int64_t from = s.model_offsets[i], to = std::min<int64_t>(s.model_offsets[i + 1], from + budget);
  static const ModelRecord kNew;
  const ModelRecord* kept = record_of(e.stage, /*make=*/false);
  const ModelRecord& record = kept ? *kept : kNew;
  j.offered = to > from;
  double d = 1.0;
  for (int64_t q = from; q < to; ++q) {
    d = std::min(d, record.estimate(size_t(q - from)));  // a chain's D never rises along it
    j.model.push_back(uint32_t(s.model_tokens[q]));
    j.model_probs.push_back(d);
  }
}

void BatchDrafter::credit_saved(const StepCost& cost, const StepScan& scan) {
  // Each request waited the step with drafts; plain decoding would have taken a step without them
  // for each of its tokens. Prefill is left out of both: it is there either way. A relative
  // seed's "seconds" are plain steps: nothing is counted until the curve is in seconds.
  const StepTiming& timed = scan.timed;
  auto step = [&](double tokens, double attention) {
    return cost.at(tokens) + cost.per_context * timed.context + cost.per_attention * attention +
           cost.per_request * double(timed.requests);
  };
  const double with = step(timed.decode_tokens, timed.attention);
  const double plain = step(timed.decode_tokens - scan.drafted_tokens, timed.attention - scan.drafted_attention);
  std::lock_guard clock(counters_mu_);
  for (const auto& [c, accepted] : *scan.verified) c->saved_seconds += accepted * plain - (with - plain);
}

void BatchDrafter::set_floors(const StepCost& cost, const StepScan& scan, bool hybrid) {
  // A token is worth drafting only if it gains at least the plain step's rate times what it adds
  // to the step; below that floor a candidate stops growing.
  // the rate to beat is decoding's, without the prefill the step carries (as step_budget.cpp)
  const double decoding = double(scan.decoding);
  const double t0 = cost.at(decoding) + cost.per_context * scan.next_context +
                    cost.per_attention * scan.next_attention + cost.per_request * double(scan.listed);
  const double rate = t0 > 0.0 ? decoding / t0 : 0.0;
  last_plain_seconds_ = cost.in_seconds && t0 > 0.0 ? t0 : 0.0;
  const double slope = std::max(cost.expected_min_slope_from(decoding), 0.0);
  for (Job& j : jobs_) j.floor = rate * (slope + cost.per_attention * j.context);
  // A model token past the first pass needs one more pass for the batch, shared by the rows
  // sent a chain that deep: before the choice, each is expected to share it with as many rows
  // as the last step sent the model's chain (price_drafter_passes settles it once they are known).
  const double share = drafter_pass_share_.load(std::memory_order_relaxed);
  pass_floor_ = hybrid ? share * decoding / double(std::max<size_t>(last_model_rows_, 1)) : 0.0;
}

void BatchDrafter::run_jobs(std::vector<std::vector<uint32_t>>& out) {
  out_ = &out;
  next_job_ = 0;
  if (workers_.empty() || jobs_.size() < kMinParallelJobs) {
    draft_range(out);
    return;
  }
  {
    std::lock_guard plock(pool_mu_);
    ++generation_;
    busy_ = workers_.size();
  }
  pool_cv_.notify_all();
  try {
    draft_range(out);
  } catch (...) {
    std::lock_guard plock(pool_mu_);
    if (!error_) error_ = std::current_exception();
  }
  std::unique_lock plock(pool_mu_);
  done_cv_.wait(plock, [&] { return busy_ == 0; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void BatchDrafter::note_drafts(const std::vector<std::vector<uint32_t>>& out) {
  last_model_rows_ = last_model_passes_ = 0;
  size_t offered = 0;
  for (Job& j : jobs_) {
    j.entry->last_draft = int32_t(out[j.index].size());
    j.use_model = j.use_model && !out[j.index].empty();  // a model chain cut to nothing drafts nothing
    j.entry->last_model = j.use_model;
    if (j.use_model) last_model_rows_ += 1, last_model_passes_ = std::max(last_model_passes_, out[j.index].size());
    offered += j.offered;
  }
  if (!offered) return;
  std::lock_guard clock(counters_mu_);  // the records fade with disuse and go cold (ModelRecord)
  for (const Job& j : jobs_) {
    if (!j.offered) continue;
    pooled_.offer();
    ModelRecord* record = record_of(j.entry->stage, /*make=*/false);  // none yet: the prior, judged pooled
    if (record == nullptr) continue;
    record->offer();  // what its chains win counts in count_verified
    if (!j.use_model) record->pass_over();
  }
}

void BatchDrafter::retire_absent() {
  // Requests that left the batch (finished, aborted or preempted) give their trees back; a
  // drafted request's output joins its stage tree.
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.seen == step_no_) {
      ++it;
      continue;
    }
    retire(it->first, e);
    it = entries_.erase(it);
  }
  if (!pending_.empty()) flush();
}

void BatchDrafter::record_timing(StepTiming timed, std::chrono::steady_clock::time_point started) {
  if (!timed_before_) return;
  using seconds = std::chrono::duration<double>;
  timed.seconds = std::max(seconds(started - last_end_).count() - timed.drafter_seconds, 0.0);
  timed.proposer_seconds = seconds(last_end_ - last_start_).count();
  std::lock_guard lock(timings_mu_);
  if (timings_.size() >= kMaxTimings)  // nobody drains them: keep the newest half
    timings_.erase(timings_.begin(), timings_.begin() + kMaxTimings / 2);
  timings_.push_back(timed);
}

std::vector<StepTiming> BatchDrafter::drain_timings() {
  std::lock_guard lock(timings_mu_);
  return std::exchange(timings_, {});
}

void BatchDrafter::set_step_cost(StepCost cost) {
  std::shared_ptr<const StepCost> next;
  if (!cost.base.empty()) {
    cost.validate();
    cost.prepare();
    next = std::make_shared<const StepCost>(std::move(cost));
  }
  std::lock_guard lock(cost_mu_);
  cost_ = std::move(next);
}

StepCost BatchDrafter::step_cost() const {
  std::lock_guard lock(cost_mu_);
  return cost_ ? *cost_ : StepCost{};
}

void BatchDrafter::spend_budget(const StepCost& cost, size_t decoding, double context, double attention, double rows,
                                std::vector<std::vector<uint32_t>>& out) {
  thread_local std::vector<BudgetRequest> requests;
  thread_local std::vector<int32_t> keep;
  requests.clear();
  for (const Job& j : jobs_)
    requests.push_back(BudgetRequest{j.candidate.probs.data(), j.candidate.probs.size(), j.confidence, j.context});
  allocate_budget(requests, decoding, context, attention, rows, cost, keep);
  for (size_t k = 0; k < jobs_.size(); ++k) {
    Job& j = jobs_[k];
    const size_t kept = size_t(keep[k]);
    double score = 0.0;
    for (size_t q = 0; q < kept; ++q) score += j.candidate.probs[q];
    j.entry->last_score = score;
    out[j.index].assign(j.candidate.tokens.begin(), j.candidate.tokens.begin() + kept);
  }
}

void BatchDrafter::price_drafter_passes(double decoding, std::vector<std::vector<uint32_t>>& out) {
  const double first = drafter_first_share_.load(std::memory_order_relaxed);
  const double share = drafter_pass_share_.load(std::memory_order_relaxed);
  // The model's tokens at depth d (from 1) need its d-th pass for the whole batch. A pass is worth
  // running only if the tokens it gives gain at least what it costs: its share x the plain step,
  // at the rate of decoding/plain step tokens a second (as the budget prices a token), so their
  // summed D must reach share x decoding. The first is priced only where it may be skipped.
  if (first > 0.0) {
    double gain = 0.0;
    for (const Job& j : jobs_)
      if (j.use_model && !out[j.index].empty()) gain += j.candidate.probs[0];
    if (gain > 0.0 && gain < first * decoding) return send_no_chain(out);
  }
  if (share <= 0.0) return;
  size_t longest = 0;
  for (const Job& j : jobs_)
    if (j.use_model) longest = std::max(longest, out[j.index].size());
  // A chain's D never rises along it, so cutting from the deepest pass keeps the best ones.
  for (size_t depth = longest; depth > 1; --depth) {
    double gain = 0.0;
    for (const Job& j : jobs_)
      if (j.use_model && out[j.index].size() >= depth) gain += j.candidate.probs[depth - 1];
    if (gain >= share * decoding) break;
    for (Job& j : jobs_) {
      if (!j.use_model || out[j.index].size() < depth) continue;
      out[j.index].resize(depth - 1);
      j.entry->last_score -= j.candidate.probs[depth - 1];
    }
  }
}

void BatchDrafter::send_no_chain(std::vector<std::vector<uint32_t>>& out) {
  // Each row the model's chain was chosen for gets the trees' candidate back, as far as the budget
  // kept the chain (the tree's tokens were the less likely, so it would keep no more of them).
  for (Job& j : jobs_) {
    if (!j.use_model) continue;
    const size_t kept = std::min(out[j.index].size(), j.tree.tokens.size());
    out[j.index].assign(j.tree.tokens.begin(), j.tree.tokens.begin() + kept);
    double score = 0.0;
    for (size_t q = 0; q < kept; ++q) score += j.tree.probs[q];
    j.entry->last_score = score;
    j.candidate = std::move(j.tree);
    j.use_model = false;
  }
}

void BatchDrafter::set_drafter_pass_cost(double first, double further) {
  for (double share : {first, further})
    if (!(share >= 0.0) || !std::isfinite(share)) throw InvalidInput("a drafter pass's share of a step must be >= 0");
  drafter_first_share_.store(first, std::memory_order_relaxed);
  drafter_pass_share_.store(further, std::memory_order_relaxed);
}

void BatchDrafter::release(const std::string& rid) {
  std::lock_guard lock(admit_mu_);
  auto it = entries_.find(rid);
  if (it == entries_.end()) return;
  retire(it->first, it->second);
  entries_.erase(it);
  if (!pending_.empty() && entries_.size() < kFewLive) flush();  // few requests to re-match: learn at once
}

void BatchDrafter::retire(const std::string& rid, const Entry& e) {
  if (e.probe) {  // a cold stage's followed request: a probe missed if the stage is cold still
    std::lock_guard clock(counters_mu_);
    ModelRecord* own = record_of(e.stage, /*make=*/false);
    if (own && stage_cold(own)) own->missed_probes = std::min(own->missed_probes + 1, ModelRecord::kMaxBackoff);
  }
  if (!e.started || !engine_.has_request(rid)) return;
  // remembered as this engine's own now, not at flush: the recorded copy may come back from the store before
  std::vector<uint32_t> output = engine_.finish_request_deferred(rid);
  if (!output.empty()) pending_.push_back({e.stage, std::move(output)});
}

void BatchDrafter::flush() {
  for (const auto& [stage, tokens] : pending_) engine_.add_document(stage, tokens.data(), tokens.size());
  pending_.clear();
}

bool BatchDrafter::prefer_model(const Job& j, double tree_score) {
  double expected = 0.0;
  for (double p : j.model_probs) expected += p;
  return !j.model.empty() && expected > tree_score;
}

void BatchDrafter::draft_range(std::vector<std::vector<uint32_t>>& out) {
  for (size_t k = next_job_.fetch_add(1); k < jobs_.size(); k = next_job_.fetch_add(1)) {
    Job& j = jobs_[k];
    if (budgeted_) {  // a candidate: the budget cuts it once every request has one
      j.candidate = engine_.speculate_candidate(*j.rid, j.budget, j.floor, &j.confidence);
      // the model's chain as a candidate of its own: grown, as the trees' is, while its D exceeds the floor
      size_t grown = 0;
      while (grown < j.model_probs.size() && j.model_probs[grown] > j.floor &&
             (grown == 0 || j.model_probs[grown] >= pass_floor_))
        ++grown;
      j.model.resize(grown), j.model_probs.resize(grown);
      if (prefer_model(j, j.confidence * j.candidate.score)) {
        j.tree = std::exchange(j.candidate, Draft{});
        j.candidate.tokens = j.model;
        j.candidate.probs = j.model_probs;
        for (double p : j.model_probs) j.candidate.score += p;
        j.confidence = 1.0;  // the record's estimates are what the model's chains got
        j.use_model = true;
      }
      continue;
    }
    Draft d = engine_.speculate(*j.rid, j.budget);
    if (prefer_model(j, d.score)) {
      double score = 0.0;
      for (double p : j.model_probs) score += p;
      j.entry->last_score = score;
      out[j.index] = j.model;
      j.use_model = true;
      continue;
    }
    j.entry->last_score = d.score;
    out[j.index] = std::move(d.tokens);
  }
}

void BatchDrafter::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(pool_mu_);
      pool_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    try {
      draft_range(*out_);
    } catch (...) {
      std::lock_guard lock(pool_mu_);
      if (!error_) error_ = std::current_exception();  // the caller rethrows it
    }
    {
      std::lock_guard lock(pool_mu_);
      --busy_;
    }
    done_cv_.notify_one();
  }
}

}  // namespace agentaccel
