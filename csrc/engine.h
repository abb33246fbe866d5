// The suffix speculation engine: one request tree per live request, one global tree per stage,
// a memory budget over the global trees, and persistence.
//
// Locking: `stages_mu_` (shared) guards every global tree; writers (add/remove/evict/load) take
// it exclusively, speculation takes it shared. Each request has its own mutex; the request map
// has another. Order: request mutex, then stages_mu_. All entry points run without the GIL.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "automaton.h"
#include "drafter.h"

namespace agentaccel {

enum TreeMask : int { kRequestTree = 1, kStageTree = 2, kUnionTree = 4 };

// How one draft is grown. The defaults live in one place, the Python SpecConfig
// (agentaccel/engine/suffix_engine.py), which sets every field; zero here means "not set".
struct SpecParams {
  int max_tokens = 0;         // most draft tokens
  bool mixture = false;       // true: agentaccel's mixture of sources; false: the paper's algorithm
  double alpha = 0.0;         // paper: MAX_SPEC = floor(alpha * p)
  int max_pattern = 0;        // P, longest pattern tried (0: max_depth)
  double min_prob = 0.0;      // nodes with D below this are never drafted
  double min_score = 0.0;     // tau: a best SCORE below it gives an empty draft (fallback)
  bool tree = false;          // false: linear (single path) drafts
  int trees = 0;              // which trees to draft from (TreeMask bits)
  double cost = 0.0;          // mixture: growth stops when a node no longer pays this cost per draft token
  int max_sources = 0;        // mixture: suffix lengths per tree mixed into one draft
  double length_power = 0.0;  // mixture: prior weight of a source = match_len ^ length_power
  double escape = 0.0;        // mixture: escape mass per distinct continuation (probability calibration)
  double escape_length = 0.0; // mixture: escape shrinks as 1 / (1 + matched / escape_length) (0: constant)
  double recency = 0.0;       // mixture: share of recency-weighted counts in request trees (needs a half-life)
  // How far the drafter's probabilities are trusted (1: as they are): every decision — growth
  // against the cost, tau, the cut on a cost curve — weighs D x confidence. Tuned per stage,
  // offline from the trace store and online from what the stage's drafts actually get accepted.
  double confidence = 0.0;
  // A measured verification cost: curve_costs[c * sizes + n] is the cost of a step verifying n
  // draft tokens over curve_contexts[c] tokens of context, relative to a plain step (sizes =
  // curve_costs.size() / curve_contexts.size()). When set, the grown draft is cut to its prefix
  // with the most expected tokens per unit of cost at the request's context (n = 0 included).
  std::vector<int64_t> curve_contexts;
  std::vector<double> curve_costs;
};

// How predictable a token sequence is from a stage tree (the paper's empirical-entropy predictor).
struct Predictability {
  uint64_t positions = 0;      // tokens scored
  uint64_t covered = 0;        // tokens whose preceding context matched a state with continuations
  double entropy_bits = 0.0;   // sum over covered tokens of the entropy of the next-token distribution
  uint64_t top1_hits = 0;      // covered tokens that were the most frequent continuation
};

struct StageStats {
  std::string name;
  uint64_t tokens, documents, bytes, states, edges;
};

// Scopes (tenants): a stage key "<stage>\x1f<scope>" names a scope's own tree of <stage>. A
// request of that key drafts from it and from the base tree "<stage>" (what the operator seeded),
// and its union holds only base and same-scope stages: no scope drafts from another's outputs.
// Drafting policies are per <stage>, shared by its scopes. The memory budget evicts from the scope
// (the base counts as one) holding the most bytes, so no scope pushes out another smaller than it.
inline constexpr char kScopeSeparator = '\x1f';

class Engine {
 public:
  Engine(int max_depth, uint64_t memory_budget_bytes, double evict_slack);

  // Global trees.
  uint64_t add_document(const std::string& stage, const uint32_t* tokens, size_t n);
  // A document another server produced (read from the shared trace store): skipped, returning -1,
  // when it is one of this engine's own recent outputs coming back recorded (each such output is
  // skipped once: the same text produced elsewhere as well still counts). Also -1 when it is what
  // a live request of its stage has produced so far: a server's recorded answer can come back
  // before its own worker learns the request finished. It is held by that request then, and its
  // finish adds it unless it is that request's own output.
  int64_t add_peer_document(const std::string& stage, const uint32_t* tokens, size_t n);
  bool remove_document(uint64_t doc_id);
  std::vector<uint64_t> document_ids(const std::string& stage) const;  // "" = every stage, oldest first

  // Requests started from now on keep recency-weighted counts with this half-life, in tokens
  // (0: none), which SpecParams::recency then mixes into their drafts.
  void set_recency_half_life(double half_life);
  double recency_half_life() const { return recency_half_life_; }

  // Requests.
  // `continue_from`: a retained finished request whose tokens are a prefix of `prompt` (the
  // previous call of an agent session); its tree is reused instead of rebuilt. Returns whether it was.
  bool start_request(const std::string& rid, const uint32_t* prompt, size_t n, const std::string& stage,
                     const std::string& continue_from = "");
  void extend(const std::string& rid, const uint32_t* tokens, size_t n);
  // Drafts with the policy of the request's stage (that stage's, else the default), at most
  // `max_tokens` tokens.
  Draft speculate(const std::string& rid, int max_tokens);
  // Drafts with explicit parameters (sweeps, tests), at most params.max_tokens tokens.
  Draft speculate_with(const std::string& rid, const SpecParams& params);
  // A candidate for a step-wide draft budget (BatchDrafter): the stage's policy, except that a
  // mixture grows while a node's confidence x D exceeds `floor` (the least any token of the step
  // needs to pay) and no cost curve cuts it: the budget does. `confidence` receives the trust the
  // budget gives the draft's estimates (the policy's confidence; 1 in paper mode).
  Draft speculate_candidate(const std::string& rid, int max_tokens, double floor, double* confidence);

  // Drafting policies, by stage name ("" = the default, used by stages without their own). A
  // stage's policy outlives its slot: a recycled stage that comes back finds it again.
  void set_policy(const std::string& stage, const SpecParams& params);
  bool clear_policy(const std::string& stage);  // back to the default; false if it had none
  SpecParams policy(const std::string& stage) const;  // what a request of `stage` drafts with
  // Frees the request; its output (tokens after the prompt) joins its stage's tree unless
  // `keep_output` is false. Returns the new document id, or -1 when nothing was added.
  // `retain`: keep the request tree (up to kMaxRetained, least recently finished dropped first)
  // so that the next call of the same session can continue from it.
  int64_t finish_request(const std::string& rid, bool keep_output, bool retain = false);
  // Frees the request as finish_request does and returns its output, which the caller adds later
  // (BatchDrafter batches them); it is remembered as this engine's own now, not when added.
  std::vector<uint32_t> finish_request_deferred(const std::string& rid);
  Draft prompt_lookup(const std::string& rid, int min_n, int max_n, int k);
  std::vector<uint32_t> request_tokens(const std::string& rid);
  bool has_request(const std::string& rid);

  // Introspection.
  std::vector<StageStats> stage_stats() const;
  Predictability predictability(const std::string& stage, const uint32_t* tokens, size_t n) const;
  // Longest prefix of `continuation` that the request tree or any global tree holds right after
  // the request context's last `k` tokens (0 when none does, or the context is shorter): what a drafter
  // matching k tokens could at best copy, were the continuation known (the replay's oracle).
  int64_t longest_continuation(const std::string& rid, int k, const uint32_t* continuation, size_t n);
  uint64_t global_bytes() const;
  // Gives back the spare capacity of the global trees' arrays and the freed heap pages behind
  // them (after a bulk seed or a rebuild).
  void compact();
  uint64_t request_bytes();
  uint64_t num_requests();
  uint64_t evicted_documents() const { return evicted_docs_; }
  int max_depth() const { return max_depth_; }
  uint64_t memory_budget() const { return budget_; }
  std::string check(bool counts) const;

  // Persistence of the global trees (versioned, checksummed; see engine.cpp for the layout).
  void save(const std::string& path) const;
  static std::unique_ptr<Engine> load(const std::string& path);

 private:
  static constexpr uint32_t kNoStage = ~uint32_t{0};
  struct Stage {
    std::string name;          // the key: "<stage>" (the base) or "<stage>\x1f<scope>" (a tenant's own)
    std::string policy_name;   // <stage>: whose drafting policy it uses (policies hold numbers, no text)
    std::string scope;         // "" for the base, every request may draft from it; else the one scope that may
    uint32_t base = kNoStage;  // a scoped stage: the base stage of the same name, drafted from beside it
    uint32_t dependents = 0;   // the base of this many scoped stages (kept while they are)
    Automaton sam{/*global_tree=*/true};
    uint64_t generation = 0;  // bumped on every change; invalidates cached request matches
    uint32_t live = 0;        // live requests of this stage (guarded by stages_mu_, exclusive)
    bool free = false;        // recycled: no name, no documents, no request; reused by the next new stage
  };
  struct Match {  // a request's matching-statistics cursor in one stage tree
    uint64_t generation = ~uint64_t{0};
    uint32_t state = 0;
    int32_t matched = 0;
    size_t consumed = 0;
  };
  struct Request {
    std::mutex mu;
    uint32_t stage;
    std::string scope;           // its stage's: the global trees it may draft from are the base and these
    size_t prompt_len;
    Automaton sam;               // request tree over prompt + output
    std::vector<Match> matches;  // indexed by stage
    std::shared_ptr<const SpecParams> policy;  // its stage's policy as of policy_version (guarded by mu)
    uint64_t policy_version = 0;
    bool finished = false;                         // set by its finish, before it leaves requests_
    std::vector<std::vector<uint32_t>> held_peers;  // peer documents equal to its output so far
  };
  // Notes an output of this engine's own requests (a finish that keeps it, now or deferred), for
  // add_peer_document to recognise.
  void remember_own_output(const std::string& stage, const uint32_t* tokens, size_t n);
  enum class Output { kDrop, kKeep, kDefer };  // what a finish does with a request's output
  int64_t finish(const std::string& rid, Output output, bool retain, std::vector<uint32_t>* deferred);
  // Holds a peer document in a live request of `stage` whose output so far it could be; see add_peer_document.
  bool hold_for_live_request(const std::string& stage, const uint32_t* tokens, size_t n);
  struct Tree {  // one candidate tree for a speculation: its states and match lengths
    const char* name;
    std::vector<const Automaton*> automata;
    std::vector<uint32_t> states;
    std::vector<int32_t> matched;
  };

  uint32_t stage_index(const std::string& name);  // creates (and a scoped stage's base); needs stages_mu_ exclusively
  // Whether a request of `scope` may draft from stage `s`: the base's stages and its own scope's.
  bool visible_locked(uint32_t s, const std::string& scope) const {
    return !stages_[s]->free && (stages_[s]->scope.empty() || stages_[s]->scope == scope);
  }
  // Frees a stage with no documents and no live request (its slot waits for the next new stage):
  // client-chosen stage names must not grow the engine past its budget. Needs stages_mu_ exclusively.
  void recycle_if_unused_locked(uint32_t idx);
  std::shared_ptr<Request> find_request(const std::string& rid);
  uint64_t global_bytes_locked() const;
  void enforce_budget_locked();
  void rebuild_without_locked(Stage& stage, const std::vector<uint64_t>& doomed);
  const Match& match_locked(Request& req, uint32_t stage_idx);
  // Needs req.mu. `floor`: a budget candidate (see speculate_candidate) grown down to this floor.
  Draft draft(Request& req, const SpecParams& params, int max_tokens, const double* floor = nullptr);
  Draft paper_best(const Tree& tree, const SpecParams& params, int max_tokens) const;
  Draft mixture(const Tree* trees, size_t num_trees, const SpecParams& params, int max_tokens,
                const double* floor) const;
  std::shared_ptr<const SpecParams> policy_for(const std::string& stage) const;
  const SpecParams* current_policy(Request& req);  // the request's stage's policy (needs req.mu)

  const int max_depth_;
  const uint64_t budget_;
  const double evict_slack_;
  std::atomic<double> recency_half_life_{0.0};  // for request trees started later

  mutable std::shared_mutex policies_mu_;  // guards policies_ (a leaf lock: nothing is taken under it)
  std::unordered_map<std::string, std::shared_ptr<const SpecParams>> policies_;  // "" = the default
  std::atomic<uint64_t> policies_version_{1};  // bumped on every change: requests re-resolve their policy

  mutable std::shared_mutex stages_mu_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::unordered_map<std::string, uint32_t> stage_by_name_;
  std::unordered_map<uint64_t, uint32_t> doc_stage_;  // live document id -> stage index
  std::vector<uint32_t> free_stages_;                 // recycled slots of stages_
  uint64_t next_doc_id_ = 1;
  uint64_t evicted_docs_ = 0;

  static constexpr size_t kStepTokens = 256;   // more than one step adds to a request (a draft and a token)
  static constexpr size_t kOwnRecent = 16384;  // own outputs remembered (many seconds of a busy server's)
  std::mutex own_mu_;                           // guards own_*; a leaf lock
  std::unordered_multiset<uint64_t> own_recent_;  // (stage, content) hashes of recent own outputs
  std::deque<uint64_t> own_order_;                // the same, oldest first, to forget the oldest

  static constexpr size_t kMaxRetained = 64;
  mutable std::mutex requests_mu_;
  std::unordered_map<std::string, std::shared_ptr<Request>> requests_;
  std::vector<std::pair<std::string, std::shared_ptr<Request>>> retained_;  // oldest first
};

}  // namespace agentaccel
