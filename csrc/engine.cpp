#include "engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>

#include "errors.h"
#include "index_file.h"
#include "prompt_lookup.h"

namespace agentaccel {

namespace {

// File layout: 40-byte header, then the payload.
//   magic "AAENGIDX" | u32 version | u32 byte-order mark | u64 payload bytes | u64 checksum | u64 0
// Payload: i32 max_depth, u64 budget, f64 slack, u64 next_doc_id, u64 evicted, u32 stages,
//   then per stage: u32 name length, name, u64 generation, automaton arrays.
constexpr char kMagic[8] = {'A', 'A', 'E', 'N', 'G', 'I', 'D', 'X'};
constexpr uint32_t kVersion = 3;  // 3: degree inside State, packed tokens, aligned arrays, saved hub
constexpr uint32_t kByteOrder = 0x01020304u;
constexpr size_t kHeaderBytes = 40;

}  // namespace

Engine::Engine(int max_depth, uint64_t memory_budget_bytes, double evict_slack)
    : max_depth_(max_depth), budget_(memory_budget_bytes), evict_slack_(evict_slack) {
  if (max_depth < 1) throw InvalidInput("max_depth must be >= 1");
  if (evict_slack < 0.0 || evict_slack >= 1.0) throw InvalidInput("evict_slack must be in [0, 1)");
}

// ---------------------------------------------------------------- global trees

uint32_t Engine::stage_index(const std::string& name) {
  auto it = stage_by_name_.find(name);
  if (it != stage_by_name_.end()) return it->second;
  const size_t sep = name.find(kScopeSeparator);
  const bool scoped = sep != std::string::npos;
  if (scoped && (sep == 0 || sep + 1 == name.size() || name.find(kScopeSeparator, sep + 1) != std::string::npos))
    throw InvalidInput("a scoped stage is named <stage>\\x1f<scope>, both non-empty");
  // A scoped stage's base exists as long as it does (empty until something is seeded into it).
  uint32_t base = kNoStage;
  if (scoped) {
    base = stage_index(name.substr(0, sep));
    ++stages_[base]->dependents;
  }
  uint32_t idx;
  if (!free_stages_.empty()) {
    idx = free_stages_.back();
    free_stages_.pop_back();
    stages_[idx]->free = false;
    stages_[idx]->sam = Automaton(/*global_tree=*/true);
  } else {
    stages_.push_back(std::make_unique<Stage>());
    idx = uint32_t(stages_.size() - 1);
  }
  Stage& s = *stages_[idx];
  s.name = name;
  s.policy_name = name.substr(0, sep);
  s.scope = scoped ? name.substr(sep + 1) : std::string();
  s.base = base;
  s.dependents = 0;
  stage_by_name_[name] = idx;
  return idx;
}

void Engine::recycle_if_unused_locked(uint32_t idx) {
  Stage& s = *stages_[idx];
  if (s.free || s.live > 0 || s.dependents > 0 || !s.sam.docs().empty()) return;
  stage_by_name_.erase(s.name);
  std::string().swap(s.name);
  std::string().swap(s.policy_name);
  std::string().swap(s.scope);
  s.sam = Automaton(/*global_tree=*/false);  // the smallest: a free slot holds no tree (made anew on reuse)
  ++s.generation;  // never reset: a request's cached match of the old stage cannot pass for the new one
  s.free = true;
  free_stages_.push_back(idx);
  if (s.base != kNoStage) {
    const uint32_t base = s.base;
    s.base = kNoStage;
    --stages_[base]->dependents;
    recycle_if_unused_locked(base);
  }
}

uint64_t Engine::add_document(const std::string& stage, const uint32_t* tokens, size_t n) {
  check_document_length(0, n);  // refused before a stage is created for it
  std::unique_lock lock(stages_mu_);
  uint32_t idx = stage_index(stage);
  uint64_t id = next_doc_id_++;
  Stage& s = *stages_[idx];
  s.sam.add_document(id, tokens, n);
  ++s.generation;
  doc_stage_[id] = idx;
  enforce_budget_locked();
  return id;
}

namespace {
uint64_t output_key(const std::string& stage, const uint32_t* tokens, size_t n) {  // FNV-1a over both
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : stage) h = (h ^ c) * 1099511628211ull;
  h = (h ^ 0xffu) * 1099511628211ull;  // stage "ab"+[..] differs from stage "a"+[b..]
  for (size_t i = 0; i < n; ++i) h = (h ^ tokens[i]) * 1099511628211ull;
  return h;
}

// Whether a recorded document is this output: the same tokens, or all but the output's last (the
// end-of-sequence token, which the recorded text, re-tokenized from the store, does not have).
bool is_recorded_copy(const uint32_t* doc, size_t n, const uint32_t* out, size_t have) {
  return (have == n || have == n + 1) && std::equal(doc, doc + n, out);
}
}  // namespace

void Engine::remember_own_output(const std::string& stage, const uint32_t* tokens, size_t n) {
  // Also without its last token: a server's output ends with the end-of-sequence token, which the
  // recorded text (re-tokenized from the store) does not have.
  uint64_t keys[2] = {output_key(stage, tokens, n), n > 1 ? output_key(stage, tokens, n - 1) : 0};
  std::lock_guard lock(own_mu_);
  for (uint64_t key : keys) {
    if (key == 0) continue;
    own_recent_.insert(key);
    own_order_.push_back(key);
  }
  while (own_order_.size() > kOwnRecent) {
    auto it = own_recent_.find(own_order_.front());
    if (it != own_recent_.end()) own_recent_.erase(it);  // (gone already when the tail consumed it)
    own_order_.pop_front();
  }
}

int64_t Engine::add_peer_document(const std::string& stage, const uint32_t* tokens, size_t n) {
  // Live requests first, then the finished: a finish remembers its output before it leaves
  // requests_, so a request missed here is found in own_recent_ below.
  if (hold_for_live_request(stage, tokens, n)) return -1;
  {
    std::lock_guard lock(own_mu_);
    auto it = own_recent_.find(output_key(stage, tokens, n));
    if (it != own_recent_.end()) {
      own_recent_.erase(it);
      return -1;
    }
  }
  return int64_t(add_document(stage, tokens, n));
}

bool Engine::hold_for_live_request(const std::string& stage, const uint32_t* tokens, size_t n) {
  uint32_t idx;
  {
    std::shared_lock lock(stages_mu_);
    auto it = stage_by_name_.find(stage);
    if (it == stage_by_name_.end()) return false;  // no stage, so no live request of it
    idx = it->second;
  }
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard lock(requests_mu_);
    for (const auto& [rid, req] : requests_)
      if (req->stage == idx) live.push_back(req);  // (set before it entered requests_, never changed)
  }
  for (const auto& req : live) {
    std::lock_guard lock(req->mu);
    if (req->finished) continue;
    const auto& toks = req->sam.tokens();
    const uint32_t* out = toks.data() + req->prompt_len;
    const size_t have = toks.size() - req->prompt_len;
    // Its output so far, or a prefix of it not longer behind than a step adds (the worker learns
    // a step's tokens at the next one).
    const bool so_far = have > 0 && have < n && n - have <= kStepTokens && std::equal(out, out + have, tokens);
    if (so_far || is_recorded_copy(tokens, n, out, have)) {
      req->held_peers.emplace_back(tokens, tokens + n);
      return true;
    }
  }
  return false;
}

bool Engine::remove_document(uint64_t doc_id) {
  std::unique_lock lock(stages_mu_);
  auto it = doc_stage_.find(doc_id);
  if (it == doc_stage_.end()) return false;
  const uint32_t idx = it->second;
  rebuild_without_locked(*stages_[idx], {doc_id});
  recycle_if_unused_locked(idx);  // as eviction does: an emptied stage frees its slot (and a scope's base)
  return true;
}

void Engine::rebuild_without_locked(Stage& stage, const std::vector<uint64_t>& doomed) {
  Automaton fresh(/*global_tree=*/true);
  for (const DocRecord& d : stage.sam.docs()) {
    if (std::find(doomed.begin(), doomed.end(), d.id) != doomed.end()) continue;
    std::vector<uint32_t> tokens = stage.sam.document_tokens(d);
    fresh.add_document(d.id, tokens.data(), tokens.size());
  }
  fresh.compact();
  stage.sam = std::move(fresh);
  ++stage.generation;
  for (uint64_t id : doomed) doc_stage_.erase(id);
}

uint64_t Engine::global_bytes_locked() const {
  uint64_t total = 0;
  // A stage without documents is request bookkeeping (it exists while requests name it, and is
  // recycled when none does), bounded by concurrency like the request trees; the budget is over
  // the documents' trees, so starting a request never evicts.
  for (const auto& s : stages_)
    if (!s->free && !s->sam.docs().empty()) total += s->sam.bytes();
  return total;
}

void Engine::enforce_budget_locked() {
  if (budget_ == 0) return;  // 0 = unlimited
  for (;;) {
    uint64_t used = global_bytes_locked();
    if (used <= budget_) return;
    // Evict documents until their estimated share frees the excess plus some slack (so that
    // rebuilds stay rare), then rebuild the stages that lost documents. Each document comes from
    // the scope holding the most bytes (the base is one scope), its oldest first: a scope is
    // evicted only while no other holds more, so none pushes out a smaller one. With one scope
    // this is the globally oldest document first.
    double goal = double(used - budget_) + evict_slack_ * double(budget_);
    std::vector<size_t> cursor(stages_.size(), 0);
    std::vector<std::vector<uint64_t>> doomed(stages_.size());
    std::unordered_map<std::string, double> held;  // scope -> bytes it holds, less what is doomed
    for (const auto& st : stages_)
      if (!st->free && !st->sam.docs().empty()) held[st->scope] += double(st->sam.bytes());
    double freed = 0.0;
    while (freed < goal) {
      int pick = -1;
      const std::string* scope = nullptr;
      for (size_t s = 0; s < stages_.size(); ++s) {
        const Stage& st = *stages_[s];
        if (cursor[s] >= st.sam.docs().size()) continue;
        const bool fatter = scope == nullptr || held[st.scope] > held[*scope];
        const bool same_and_older = scope != nullptr && st.scope == *scope &&
                                    st.sam.docs()[cursor[s]].id < stages_[pick]->sam.docs()[cursor[pick]].id;
        if (fatter && (scope == nullptr || st.scope != *scope)) pick = int(s), scope = &st.scope;
        else if (same_and_older) pick = int(s);
      }
      if (pick < 0) break;
      const Automaton& sam = stages_[pick]->sam;
      const DocRecord& d = sam.docs()[cursor[pick]++];
      const double share = double(sam.bytes()) * double(d.length + 1) / double(sam.num_tokens() + sam.docs().size());
      freed += share;
      held[*scope] -= share;
      doomed[pick].push_back(d.id);
    }
    size_t evicted = 0;
    for (size_t s = 0; s < stages_.size(); ++s)
      if (!doomed[s].empty()) {
        rebuild_without_locked(*stages_[s], doomed[s]);
        evicted += doomed[s].size();
        recycle_if_unused_locked(uint32_t(s));
      }
    evicted_docs_ += evicted;
    if (evicted == 0) return;  // nothing left to evict: the fixed overhead alone is over budget
  }
}

std::vector<uint64_t> Engine::document_ids(const std::string& stage) const {
  std::shared_lock lock(stages_mu_);
  std::vector<uint64_t> ids;
  for (const auto& s : stages_)
    if (stage.empty() || s->name == stage)
      for (const DocRecord& d : s->sam.docs()) ids.push_back(d.id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// ---------------------------------------------------------------- requests

std::shared_ptr<Engine::Request> Engine::find_request(const std::string& rid) {
  std::lock_guard lock(requests_mu_);
  auto it = requests_.find(rid);
  if (it == requests_.end()) throw UnknownKey("unknown request id: " + rid);
  return it->second;
}

bool Engine::start_request(const std::string& rid, const uint32_t* prompt, size_t n, const std::string& stage,
                           const std::string& continue_from) {
  std::shared_ptr<Request> previous;
  {
    std::lock_guard lock(requests_mu_);
    if (requests_.count(rid)) throw InvalidInput("request id already started: " + rid);
    if (!continue_from.empty())
      for (auto it = retained_.begin(); it != retained_.end(); ++it)
        if (it->first == continue_from) {
          previous = std::move(it->second);
          retained_.erase(it);
          break;
        }
  }
  auto req = std::make_shared<Request>();
  req->prompt_len = n;
  bool reused = false;
  if (previous) {
    const auto& old = previous->sam.tokens();
    const size_t have = old.size();  // read before the move below empties `old`
    if (have <= n && std::equal(old.begin(), old.end(), prompt)) {
      req->sam = std::move(previous->sam);
      req->sam.append(prompt + have, n - have);
      reused = true;
    }
  }
  if (!reused) {  // built before taking any lock: prompts can be long
    req->sam.set_recency(recency_half_life_);
    req->sam.append(prompt, n);
  }
  uint32_t idx;
  {
    std::unique_lock lock(stages_mu_);
    idx = req->stage = stage_index(stage);
    req->scope = stages_[idx]->scope;
    ++stages_[idx]->live;
  }
  bool added;
  {
    std::lock_guard lock(requests_mu_);
    added = requests_.emplace(rid, std::move(req)).second;
  }
  if (!added) {  // started meanwhile by another thread under the same id
    std::unique_lock lock(stages_mu_);
    --stages_[idx]->live;
    recycle_if_unused_locked(idx);
    throw InvalidInput("request id already started: " + rid);
  }
  return reused;
}

Draft Engine::prompt_lookup(const std::string& rid, int min_n, int max_n, int k) {
  auto req = find_request(rid);
  std::lock_guard lock(req->mu);
  const auto& toks = req->sam.tokens();
  return agentaccel::prompt_lookup(toks.data(), toks.size(), min_n, max_n, k);
}

void Engine::extend(const std::string& rid, const uint32_t* tokens, size_t n) {
  auto req = find_request(rid);
  std::lock_guard lock(req->mu);
  req->sam.append(tokens, n);
}

int64_t Engine::finish_request(const std::string& rid, bool keep_output, bool retain) {
  return finish(rid, keep_output ? Output::kKeep : Output::kDrop, retain, nullptr);
}

std::vector<uint32_t> Engine::finish_request_deferred(const std::string& rid) {
  std::vector<uint32_t> output;
  finish(rid, Output::kDefer, /*retain=*/false, &output);
  return output;
}

int64_t Engine::finish(const std::string& rid, Output output, bool retain, std::vector<uint32_t>* deferred) {
  std::shared_ptr<Request> req = find_request(rid);
  int64_t doc = -1;
  {
    std::lock_guard rlock(req->mu);
    if (req->finished) throw UnknownKey("unknown request id: " + rid);  // finished by another thread
    req->finished = true;
    std::string stage;
    {
      std::shared_lock lock(stages_mu_);
      stage = stages_[req->stage]->name;
    }
    const auto& toks = req->sam.tokens();
    const uint32_t* out = toks.data() + req->prompt_len;
    const size_t have = toks.size() - req->prompt_len;
    // Held peer documents: the one that is this output came back recorded (it is this output,
    // added or dropped below); the others are other servers' after all.
    bool came_back = false;
    for (const auto& peer : req->held_peers) {
      if (output != Output::kDrop && !came_back && is_recorded_copy(peer.data(), peer.size(), out, have))
        came_back = true;
      else
        add_document(stage, peer.data(), peer.size());
    }
    req->held_peers.clear();
    if (output != Output::kDrop && have > 0) {
      if (output == Output::kKeep) doc = int64_t(add_document(stage, out, have));
      else deferred->assign(out, out + have);
      if (!came_back) remember_own_output(stage, out, have);
    }
    req->matches.clear();
    {
      std::lock_guard lock(requests_mu_);  // after the above: a peer document missing it finds it remembered
      requests_.erase(rid);
    }
    std::unique_lock lock(stages_mu_);
    --stages_[req->stage]->live;
    recycle_if_unused_locked(req->stage);
  }
  if (retain) {
    std::lock_guard lock(requests_mu_);
    retained_.emplace_back(rid, std::move(req));
    if (retained_.size() > kMaxRetained) retained_.erase(retained_.begin());
  }
  return doc;
}

std::vector<uint32_t> Engine::request_tokens(const std::string& rid) {
  auto req = find_request(rid);
  std::lock_guard lock(req->mu);
  return req->sam.tokens();
}

int64_t Engine::longest_continuation(const std::string& rid, int k, const uint32_t* continuation, size_t n) {
  if (k < 1) throw InvalidInput("k must be at least 1");
  auto req = find_request(rid);
  std::lock_guard rlock(req->mu);
  std::shared_lock lock(stages_mu_);
  const auto& ctx = req->sam.tokens();
  if (ctx.size() < size_t(k)) return 0;
  std::vector<uint32_t> pattern(ctx.end() - k, ctx.end());
  pattern.insert(pattern.end(), continuation, continuation + n);
  // A walk from the root follows the pattern as far as the tree holds it as a substring.
  auto walk = [&](const Automaton& a) {
    uint32_t state = 0;
    int64_t len = 0;
    for (uint32_t t : pattern) {
      state = a.next(state, t);
      if (state == kNil) break;
      ++len;
    }
    return len;
  };
  int64_t best = walk(req->sam);
  for (uint32_t s = 0; s < stages_.size(); ++s)
    if (visible_locked(s, req->scope)) best = std::max(best, walk(stages_[s]->sam));
  return std::max<int64_t>(best - k, 0);
}

void Engine::set_recency_half_life(double half_life) {
  if (!(half_life >= 0.0)) throw InvalidInput("recency half-life must be >= 0");
  recency_half_life_ = half_life;
}

bool Engine::has_request(const std::string& rid) {
  std::lock_guard lock(requests_mu_);
  return requests_.count(rid) > 0;
}

const Engine::Match& Engine::match_locked(Request& req, uint32_t stage_idx) {
  if (req.matches.size() < stages_.size()) req.matches.resize(stages_.size());
  Match& m = req.matches[stage_idx];
  const Stage& stage = *stages_[stage_idx];
  const auto& ctx = req.sam.tokens();
  if (m.generation != stage.generation) {
    // The tree changed: re-match the last max_depth tokens (no pattern is longer).
    m = Match{stage.generation, 0, 0, ctx.size() > size_t(max_depth_) ? ctx.size() - max_depth_ : 0};
  }
  for (; m.consumed < ctx.size(); ++m.consumed) stage.sam.step(m.state, m.matched, ctx[m.consumed]);
  return m;
}

void Engine::set_policy(const std::string& stage, const SpecParams& params) {
  if (params.max_tokens < 0 || params.min_prob < 0 || params.cost < 0 || params.max_pattern < 0 ||
      params.confidence < 0)
    throw InvalidInput("drafting policy: max_tokens, min_prob, cost, confidence and max_pattern must be >= 0");
  if (!params.curve_contexts.empty() &&
      (params.curve_costs.empty() || params.curve_costs.size() % params.curve_contexts.size() != 0))
    throw InvalidInput("drafting policy: the cost curve needs the same draft sizes at every context");
  if (params.curve_contexts.empty() != params.curve_costs.empty())
    throw InvalidInput("drafting policy: a cost curve needs both contexts and costs");
  if (std::adjacent_find(params.curve_contexts.begin(), params.curve_contexts.end(), std::greater_equal<>()) !=
      params.curve_contexts.end())
    throw InvalidInput("drafting policy: the cost curve's contexts must be increasing");
  for (double c : params.curve_costs)
    if (!(c > 0)) throw InvalidInput("drafting policy: every cost of the curve must be positive");
  auto shared = std::make_shared<const SpecParams>(params);
  std::unique_lock lock(policies_mu_);
  policies_[stage] = std::move(shared);
  policies_version_.fetch_add(1, std::memory_order_release);
}

bool Engine::clear_policy(const std::string& stage) {
  if (stage.empty()) throw InvalidInput("the default policy cannot be cleared, only replaced");
  std::unique_lock lock(policies_mu_);
  const bool had = policies_.erase(stage) > 0;
  policies_version_.fetch_add(1, std::memory_order_release);
  return had;
}

std::shared_ptr<const SpecParams> Engine::policy_for(const std::string& stage) const {
  std::shared_lock lock(policies_mu_);
  auto it = policies_.find(stage);
  if (it == policies_.end()) it = policies_.find("");
  return it == policies_.end() ? nullptr : it->second;
}

SpecParams Engine::policy(const std::string& stage) const {
  auto p = policy_for(stage);
  return p ? *p : SpecParams{};
}

const SpecParams* Engine::current_policy(Request& req) {
  // The request keeps its stage's policy until a policy changes: no name lookup per draft.
  const uint64_t version = policies_version_.load(std::memory_order_acquire);
  if (req.policy_version != version) {
    std::shared_lock lock(stages_mu_);
    req.policy = policy_for(stages_[req.stage]->policy_name);
    req.policy_version = version;
  }
  return req.policy.get();
}

Draft Engine::speculate(const std::string& rid, int max_tokens) {
  auto req = find_request(rid);
  std::lock_guard rlock(req->mu);
  const SpecParams* policy = current_policy(*req);
  if (!policy) return Draft{};  // no policy set: nothing to draft with
  return draft(*req, *policy, std::min(max_tokens, policy->max_tokens));
}

Draft Engine::speculate_candidate(const std::string& rid, int max_tokens, double floor, double* confidence) {
  if (!(floor >= 0.0)) throw InvalidInput("a budget candidate's floor must be >= 0");
  auto req = find_request(rid);
  std::lock_guard rlock(req->mu);
  const SpecParams* policy = current_policy(*req);
  if (confidence) *confidence = policy && policy->mixture ? policy->confidence : 1.0;
  if (!policy) return Draft{};
  return draft(*req, *policy, std::min(max_tokens, policy->max_tokens), &floor);
}

Draft Engine::speculate_with(const std::string& rid, const SpecParams& params) {
  auto req = find_request(rid);
  std::lock_guard rlock(req->mu);
  return draft(*req, params, params.max_tokens);
}

namespace {
// Keeps the draft's prefix with the most expected tokens per unit of verification cost under
// the measured curve, interpolated at the request's context length. The draft was grown best
// node first, so every prefix is a valid tree and its expected accepted length is the sum of
// its nodes' D.
void keep_best_rate_prefix(Draft& d, const SpecParams& p, double trust, size_t context) {
  const size_t curves = p.curve_contexts.size();
  const size_t sizes = p.curve_costs.size() / curves;
  const auto& ctx = p.curve_contexts;
  const size_t i = size_t(std::upper_bound(ctx.begin(), ctx.end(), int64_t(context)) - ctx.begin());
  const size_t lo = i == 0 ? 0 : i - 1, hi = i == curves ? curves - 1 : i;
  const double w = lo == hi ? 0.0 : double(int64_t(context) - ctx[lo]) / double(ctx[hi] - ctx[lo]);
  auto cost = [&](size_t n) {
    const double a = p.curve_costs[lo * sizes + n], b = p.curve_costs[hi * sizes + n];
    return a + w * (b - a);
  };
  size_t best_n = 0;
  double best_rate = 1.0 / cost(0), expected = 1.0;  // every step yields one token, plus accepted drafts
  for (size_t n = 1; n <= std::min(d.tokens.size(), sizes - 1); ++n) {
    expected += trust * d.probs[n - 1];
    const double rate = expected / cost(n);
    if (rate > best_rate) best_n = n, best_rate = rate;
  }
  d.tokens.resize(best_n);
  d.parents.resize(best_n);
  d.probs.resize(best_n);
  d.score = 0.0;
  for (double q : d.probs) d.score += q;
  if (best_n == 0) d.source.clear();
}
}  // namespace

Draft Engine::draft(Request& request, const SpecParams& params, int max_tokens, const double* floor) {
  Request* req = &request;  // as the body reads it
  max_tokens = std::max(max_tokens, 0);
  std::shared_lock lock(stages_mu_);

  // Tree lists are reused per thread: a step allocates nothing for them once warm.
  thread_local std::vector<Tree> trees;
  size_t used = 0;
  auto add_tree = [&](const char* name) -> Tree& {
    if (used == trees.size()) trees.emplace_back();
    Tree& t = trees[used++];
    t.name = name;
    t.automata.clear();
    t.states.clear();
    t.matched.clear();
    return t;
  };
  if (params.trees & kRequestTree) {
    Tree& t = add_tree("request");
    t.automata.push_back(&req->sam);
    t.states.push_back(req->sam.last());
    t.matched.push_back(int32_t(req->sam.num_tokens()));
  }
  // The stage tree: the request's own stage, and beside it the base of a scoped stage.
  const uint32_t own[2] = {req->stage, stages_[req->stage]->base};
  const bool with_stage = params.trees & kStageTree;
  if (with_stage) {
    Tree& t = add_tree("stage");
    for (uint32_t s : own) {
      if (s == kNoStage) continue;
      const Match& m = match_locked(*req, s);
      t.automata.push_back(&stages_[s]->sam);
      t.states.push_back(m.state);
      t.matched.push_back(m.matched);
    }
  }
  // In paper mode a union of the request's own stage alone is the stage tree again: same draft,
  // and ties keep the earlier tree, so it is skipped.
  const bool union_is_stage =
      !params.mixture && with_stage && stages_.size() - free_stages_.size() == 1;
  if ((params.trees & kUnionTree) && !union_is_stage) {
    Tree& all = add_tree("union");
    for (uint32_t s = 0; s < stages_.size(); ++s) {
      if (!visible_locked(s, req->scope)) continue;  // another scope's outputs: never drafted from
      // A mixture already has the request's own stage as a source: the union adds the others.
      if (params.mixture && with_stage && (s == own[0] || s == own[1])) continue;
      const Match& m = match_locked(*req, s);
      all.automata.push_back(&stages_[s]->sam);
      all.states.push_back(m.state);
      all.matched.push_back(m.matched);
    }
  }

  Draft best;
  if (!params.mixture) {
    bool have = false;
    for (size_t i = 0; i < used; ++i) {
      const Tree& t = trees[i];
      Draft d = paper_best(t, params, max_tokens);
      if (!have || d.score > best.score) {  // ties keep the earlier tree
        best = std::move(d);
        best.source = t.name;
        have = true;
      }
    }
  } else {
    best = mixture(trees.data(), used, params, max_tokens, floor);
  }
  if (best.tokens.empty()) best.source.clear();
  const double trust = params.mixture ? params.confidence : 1.0;
  if (trust * best.score < params.min_score) {  // the paper's fallback: no suffix draft this step
    best.tokens.clear();
    best.parents.clear();
    best.probs.clear();
    best.source.clear();
  }
  if (!params.curve_costs.empty() && !best.tokens.empty() && floor == nullptr)
    keep_best_rate_prefix(best, params, trust, req->sam.num_tokens());
  return best;
}

Draft Engine::paper_best(const Tree& tree, const SpecParams& params, int max_tokens) const {
  const int depth = max_depth_;
  const int longest = params.max_pattern > 0 ? std::min(params.max_pattern, depth) : depth;
  int32_t max_matched = 0;
  for (int32_t m : tree.matched) max_matched = std::max(max_matched, m);
  GrowLimits lim;
  lim.min_prob = params.min_prob;
  lim.tree = params.tree;

  // Candidates grow in per-thread buffers and are swapped in when better: a step allocates
  // little more than the draft it returns (one draft per pattern range was ~half of a step).
  thread_local std::vector<Source> roots;
  thread_local Draft range_best, candidate;
  auto draft_for = [&](int p, bool* hit, Draft& out) {
    lim.budget = std::min(max_tokens, int(std::floor(params.alpha * p)));
    lim.room = depth - p;
    grow_draft(roots, lim, hit, out);
    out.match_len = p;
  };

  Draft best;
  bool have = false;
  // Patterns p = 1..P, scanned from the longest: all p whose matched states coincide share one
  // set of counts, and the longest of them has the largest MAX_SPEC, so unless the depth limit
  // cut its draft it is at least as good as every shorter p of the range (and wins ties).
  for (int p = std::min(longest, max_matched); p >= 1;) {
    // SCORE <= MAX_SPEC (every D is at most 1) and MAX_SPEC only shrinks with p: once the best
    // reaches it, no shorter pattern can beat it (ties go to the longer pattern anyway).
    if (have && best.score >= double(std::min(max_tokens, int(std::floor(params.alpha * p))))) break;
    roots.clear();
    int lo = 0;
    for (size_t i = 0; i < tree.automata.size(); ++i) {
      if (tree.matched[i] < p) {
        lo = std::max(lo, int(tree.matched[i]));
        continue;
      }
      const Automaton& a = *tree.automata[i];
      uint32_t st = a.ancestor_for_length(tree.states[i], p);
      int32_t link = a.state(st).link;
      lo = std::max(lo, link < 0 ? 0 : int(a.state(link).len));
      roots.push_back(Source{&a, st, 1.0});
    }
    bool hit = false;
    draft_for(p, &hit, range_best);
    if (hit)
      for (int q = p - 1; q > lo; --q) {
        bool ignored = false;
        draft_for(q, &ignored, candidate);
        if (candidate.score > range_best.score) std::swap(range_best, candidate);
      }
    if (!have || range_best.score > best.score) {  // ties keep the longer pattern
      std::swap(best, range_best);
      have = true;
    }
    p = lo;
  }
  return best;
}

Draft Engine::mixture(const Tree* trees, size_t num_trees, const SpecParams& params, int max_tokens,
                      const double* floor) const {
  const int longest = params.max_pattern > 0 ? params.max_pattern : max_depth_;
  thread_local std::vector<Source> sources;  // reused: no allocation per step once warm
  sources.clear();
  int32_t match_len = 0;
  for (const Tree& t : std::span(trees, num_trees))
    for (size_t i = 0; i < t.automata.size(); ++i) {
      const Automaton& a = *t.automata[i];
      int32_t len = std::min<int32_t>(t.matched[i], longest);
      if (len <= 0) continue;
      uint32_t st = a.ancestor_for_length(t.states[i], len);
      // Walk to shorter suffixes; each state that has continuations is one source of evidence.
      for (int taken = 0; taken < params.max_sources && st != 0;) {
        if (a.has_children(st)) {
          const double prior = params.length_power == 1.0 ? double(len) : std::pow(double(len), params.length_power);
          sources.push_back(Source{&a, st, prior, len});
          match_len = std::max(match_len, len);
          ++taken;
        }
        st = uint32_t(a.state(st).link);
        len = a.state(st).len;
      }
    }
  GrowLimits lim;
  lim.budget = max_tokens;
  lim.room = 1 << 30;
  lim.min_prob = params.min_prob;
  lim.cost = floor ? *floor : params.cost;
  lim.fixed_threshold = floor != nullptr;
  lim.escape = params.escape;
  lim.escape_length = params.escape_length;
  lim.recency = params.recency;
  lim.confidence = params.confidence;
  lim.tree = params.tree;
  lim.mixture = true;
  bool ignored = false;
  Draft d;
  grow_draft(sources, lim, &ignored, d);
  d.match_len = match_len;
  d.source = "mixture";
  return d;
}

// ---------------------------------------------------------------- introspection

std::vector<StageStats> Engine::stage_stats() const {
  std::shared_lock lock(stages_mu_);
  std::vector<StageStats> out;
  for (const auto& s : stages_)
    if (!s->free)
      out.push_back(StageStats{s->name, s->sam.num_tokens(), s->sam.docs().size(), s->sam.bytes(),
                             s->sam.num_states(), s->sam.num_edges()});
  return out;
}

Predictability Engine::predictability(const std::string& stage, const uint32_t* tokens, size_t n) const {
  std::shared_lock lock(stages_mu_);
  Predictability out;
  out.positions = n;
  auto it = stage_by_name_.find(stage);
  if (it == stage_by_name_.end()) return out;
  const Automaton& a = stages_[it->second]->sam;
  uint32_t state = 0;
  int32_t matched = 0;
  std::vector<Child> kids;
  for (size_t i = 0; i < n; ++i) {
    uint32_t st = matched > 0 ? a.ancestor_for_length(state, std::min(matched, max_depth_)) : 0;
    if (matched > 0 && a.has_children(st)) {
      a.children(st, kids);
      double total = 0.0, h = 0.0;
      const Child* best = &kids[0];
      for (const Child& k : kids) {
        total += k.count;
        if (k.count > best->count || (k.count == best->count && k.token < best->token)) best = &k;
      }
      for (const Child& k : kids) {
        double p = k.count / total;
        h -= p * std::log2(p);
      }
      out.entropy_bits += h;
      ++out.covered;
      if (best->token == tokens[i]) ++out.top1_hits;
    }
    a.step(state, matched, tokens[i]);
  }
  return out;
}

void Engine::compact() {
  std::unique_lock lock(stages_mu_);
  for (auto& stage : stages_) stage->sam.compact();
}

uint64_t Engine::global_bytes() const {
  std::shared_lock lock(stages_mu_);
  return global_bytes_locked();
}

uint64_t Engine::request_bytes() {
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard lock(requests_mu_);
    for (auto& kv : requests_) live.push_back(kv.second);
    for (auto& kv : retained_) live.push_back(kv.second);
  }
  uint64_t total = 0;
  for (auto& r : live) {
    std::lock_guard lock(r->mu);
    total += r->sam.bytes();
  }
  return total;
}

uint64_t Engine::num_requests() {
  std::lock_guard lock(requests_mu_);
  return requests_.size();
}

std::string Engine::check(bool counts) const {
  std::vector<std::pair<std::string, std::shared_ptr<Request>>> live;
  {
    std::lock_guard lock(requests_mu_);
    live.assign(requests_.begin(), requests_.end());
  }
  for (const auto& [rid, req] : live) {  // request trees first: a request's mutex comes before stages_mu_
    std::lock_guard rlock(req->mu);
    std::string problem = req->sam.check();
    if (problem.empty() && counts) problem = req->sam.check_counts();
    if (!problem.empty()) return "request '" + rid + "': " + problem;
  }
  std::shared_lock lock(stages_mu_);
  size_t docs = 0;
  for (uint32_t s = 0; s < stages_.size(); ++s) {
    const Automaton& a = stages_[s]->sam;
    std::string problem = a.check();
    if (problem.empty() && counts) problem = a.check_counts();
    if (!problem.empty()) return "stage '" + stages_[s]->name + "': " + problem;
    for (const DocRecord& d : a.docs()) {
      auto it = doc_stage_.find(d.id);
      if (it == doc_stage_.end() || it->second != s) return "document map out of sync for id " + std::to_string(d.id);
    }
    docs += a.docs().size();
    const Stage& st = *stages_[s];
    if (!st.free && st.base != kNoStage &&
        (stages_[st.base]->free || stages_[st.base]->name != st.policy_name || stages_[st.base]->dependents == 0))
      return "scoped stage '" + st.name + "' lost its base";
    auto named = stage_by_name_.find(stages_[s]->name);
    if (stages_[s]->free ? !a.docs().empty() || stages_[s]->live > 0
                         : named == stage_by_name_.end() || named->second != s)
      return "stage slot " + std::to_string(s) + " out of sync with the stage names";
  }
  if (stage_by_name_.size() + free_stages_.size() != stages_.size()) return "stage name map has stale entries";
  if (docs != doc_stage_.size()) return "document map has stale entries";
  if (budget_ > 0 && global_bytes_locked() > budget_ && docs > 0) return "memory budget exceeded";
  return {};
}

// ---------------------------------------------------------------- persistence

void Engine::save(const std::string& path) const {
  // Written beside the target and renamed: a crash never leaves a half-written index in place.
  // The payload streams to the file; the header (size, checksum) is written last, at the front.
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw InvalidInput("cannot write " + path + ": " + std::strerror(errno));
  bool ok = std::fseek(f, long(kHeaderBytes), SEEK_SET) == 0;
  IndexWriter out(f);
  {
    std::shared_lock lock(stages_mu_);
    out.put(int32_t(max_depth_));
    out.put(budget_);
    out.put(evict_slack_);
    out.put(next_doc_id_);
    out.put(evicted_docs_);
    out.put(uint32_t(stages_.size() - free_stages_.size()));
    for (const auto& s : stages_) {
      if (s->free) continue;
      out.put(uint32_t(s->name.size()));
      out.append(s->name.data(), s->name.size());
      out.put(s->generation);
      s->sam.write(out);
    }
  }
  char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, 8);
  const uint64_t payload = out.size(), sum = out.checksum();
  std::memcpy(header + 8, &kVersion, 4);
  std::memcpy(header + 12, &kByteOrder, 4);
  std::memcpy(header + 16, &payload, 8);
  std::memcpy(header + 24, &sum, 8);
  ok = ok && out.ok() && std::fseek(f, 0, SEEK_SET) == 0 && std::fwrite(header, 1, kHeaderBytes, f) == kHeaderBytes;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw InvalidInput("cannot write " + path + ": " + std::strerror(errno));
  }
}

std::unique_ptr<Engine> Engine::load(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw InvalidInput("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw InvalidInput("cannot stat " + path);
  }
  size_t size = size_t(st.st_size);
  if (size < kHeaderBytes) {
    ::close(fd);
    throw InvalidInput(path + " is not an agentaccel index (too short: " + std::to_string(size) + " bytes)");
  }
  // Private and writable: the arrays are used in place (no copy at load); a page written later
  // (counts of a grown tree) is copied by the kernel, never written back to the file.
  // Populated read-only (a writable populate would copy every page up front), then opened for
  // writing.
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) throw InvalidInput("cannot map " + path + ": " + std::strerror(errno));
  std::shared_ptr<void> mapping(map, [size](void* m) { ::munmap(m, size); });
  if (::mprotect(map, size, PROT_READ | PROT_WRITE) != 0)
    throw InvalidInput("cannot map " + path + ": " + std::strerror(errno));

  char* base = static_cast<char*>(map);
  char* p = base + 8;
  char* header_end = base + kHeaderBytes;
  if (std::memcmp(base, kMagic, 8) != 0) throw InvalidInput(path + " is not an agentaccel index (bad magic)");
  uint32_t version = read_scalar<uint32_t>(p, header_end);
  if (version != kVersion)
    throw InvalidInput(path + ": unsupported index version " + std::to_string(version) + " (this build reads " +
                       std::to_string(kVersion) + ")");
  if (read_scalar<uint32_t>(p, header_end) != kByteOrder) throw InvalidInput(path + ": written on a machine of another byte order");
  uint64_t payload_size = read_scalar<uint64_t>(p, header_end);
  uint64_t sum = read_scalar<uint64_t>(p, header_end);
  if (payload_size != size - kHeaderBytes)
    throw InvalidInput(path + " is truncated or padded: header promises " + std::to_string(payload_size) +
                       " payload bytes, file has " + std::to_string(size - kHeaderBytes));
  p = header_end;
  const char* end = base + size;
  if (checksum(p, payload_size) != sum) throw InvalidInput(path + " is corrupt (checksum mismatch)");

  try {
    int32_t depth = read_scalar<int32_t>(p, end);
    uint64_t budget = read_scalar<uint64_t>(p, end);
    double slack = read_scalar<double>(p, end);
    auto eng = std::make_unique<Engine>(depth, budget, slack);
    eng->next_doc_id_ = read_scalar<uint64_t>(p, end);
    eng->evicted_docs_ = read_scalar<uint64_t>(p, end);
    uint32_t nstages = read_scalar<uint32_t>(p, end);
    std::unordered_set<std::string> read;
    for (uint32_t i = 0; i < nstages; ++i) {
      uint32_t len = read_scalar<uint32_t>(p, end);
      if (len > size_t(end - p)) throw InvalidInput("stage name longer than the file");
      std::string name(p, len);
      p += len;
      // (A scoped stage read earlier made its base, empty: the base's own record fills it.)
      if (!read.insert(name).second) throw InvalidInput("stage '" + name + "' stored twice");
      uint32_t idx = eng->stage_index(name);
      Stage& s = *eng->stages_[idx];
      s.generation = read_scalar<uint64_t>(p, end);
      s.sam.read(p, end, mapping);
      for (const DocRecord& d : s.sam.docs()) {
        if (d.id >= eng->next_doc_id_ || !eng->doc_stage_.emplace(d.id, idx).second)
          throw InvalidInput("document id " + std::to_string(d.id) + " repeated or out of range");
      }
    }
    if (p != end) throw InvalidInput("trailing bytes after the last stage");
    return eng;
  } catch (const std::exception& e) {
    throw InvalidInput(path + " is corrupt: " + e.what());
  }
}

}  // namespace agentaccel
