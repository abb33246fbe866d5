// Drafts for every request of one inference step in a single call (vLLM's proposer): starts
// the requests it has not seen, appends each one's newly sampled tokens, drafts, finishes the
// requests that left the batch, and counts draft statistics per stage. Drafting itself runs on
// a small pool of threads when the batch is large enough to pay for the hand-off.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.h"
#include "step_budget.h"

namespace agentaccel {

struct StageCounters {
  uint64_t steps = 0;     // verification steps of a draft proposed the step before
  uint64_t drafted_steps = 0;  // of those, steps whose draft was not empty
  uint64_t drafted = 0;   // draft tokens those steps verified
  uint64_t accepted = 0;  // draft tokens accepted
  uint64_t tokens = 0;    // tokens produced (accepted + the one the model adds each step)
  double predicted = 0.0; // expected accepted tokens of those drafts (sum of their scores)
  double saved_seconds = 0.0;  // what plain decoding would have taken those requests more, under the
                               // step cost: a accepted tokens save a plain steps, the drafts made the step longer
  // Steps that verified the model drafter's chain instead of the trees' (the hybrid): counted here,
  // not in drafted_steps / drafted / accepted / predicted above, which stay the trees' own.
  uint64_t model_drafted_steps = 0;
  uint64_t model_drafted = 0;     // the model's draft tokens those steps verified
  uint64_t model_accepted = 0;    // of which accepted
  double model_predicted = 0.0;   // the accepted tokens the model's record expected of them
  uint64_t model_unfollowed = 0;  // requests the model drafter did not follow (started on a cold stage)
};

// What the model drafter's chains got accepted on one stage (the hybrid): at each depth j of a
// chain, how many chains reached it (`tried`) and how many had tokens 0..j all accepted
// (`reached`). Its estimate of depth j, (reached + prior) / (tried + weight), is the model's D:
// the budget prices the model's tokens with it as it prices the trees' with theirs.
// The counts fade, so that no past locks the model out of a stage: past kHorizon chains they are
// halved (what the head gets now outweighs what it got long ago, a retrained head included), and
// every kFadeAfter rows offered a chain and not sent it they lose a quarter, which brings the
// estimate back towards the prior: a stage whose record fell below what a token must gain is
// tried again now and then, and sent the model's chains again if they are accepted now.
//
// A stage where the model's chains won less than one token per kColdAfter rows offered one, over
// the last rows offered (at least kColdAfter of them; the counts halved every kColdWindow, so that
// what it wins now decides), is cold: the model's drafter follows only one in probe_interval() of
// the requests that start there (it writes their positions into its KV cache, from their prompt on,
// and only they are offered chains), so that a head that (almost) never wins on a stage costs
// nothing on most of its requests, and the followed few keep trying it (chains of theirs accepted
// at that rate warm the stage again). Each followed request that ends with the stage still cold
// doubles the interval, up to kProbeEvery << kMaxBackoff: a head that keeps losing is tried ever
// more rarely. A stage with fewer than kColdAfter rows of its own is judged by the head's record
// over all stages (BatchDrafter's pooled record): a head that wins nothing anywhere starts cold on a
// new stage, rather than paying a small stage's first kColdAfter rows.
// A stage is cold too where what its chains' accepted tokens saved (`worth`) is less than what the
// drafter's passes over its followed requests took (`spent`; their prompts and catch-ups included),
// both in plain steps of the batch over the same rows: a head that wins a token now and then but
// costs more passes than those tokens save is followed no more than one that wins nothing.
struct ModelRecord {
  std::vector<uint64_t> tried, reached;
  uint64_t passed = 0;  // rows offered a chain and not sent it since the last fade (not kept in the store)
  uint64_t offered = 0;  // rows offered a chain lately (halved with `won` each kColdWindow; not kept in the store)
  uint64_t won = 0;      // tokens of the chains sent to them accepted (not kept in the store)
  double worth = 0.0;    // plain steps of the batch those tokens saved: 1 / the rows decoding each (halved likewise; not kept)
  double spent = 0.0;    // plain steps of the batch the drafter's passes took for its followed requests (halved likewise; not kept)
  uint64_t cold_starts = 0;  // requests started on the stage while it was cold (not kept in the store)
  uint32_t missed_probes = 0;  // its followed requests that ended with it still cold, since it was warm
  static constexpr double kPrior = 0.5;   // a new stage's chain: each token accepted half the time ...
  static constexpr double kWeight = 4.0;  // ... worth this many chains
  static constexpr uint64_t kHorizon = 1024;   // chains a record holds before its counts are halved
  static constexpr uint64_t kFadeAfter = 256;  // rows passed over before the counts lose a quarter
  static constexpr uint64_t kColdAfter = 128;  // rows offered per token accepted, past which it is cold
  static constexpr uint64_t kColdWindow = 1024;  // rows offered before `offered` and `won` are halved
  static constexpr uint64_t kProbeEvery = 8;   // a cold stage's requests: one in this many followed ...
  static constexpr uint32_t kMaxBackoff = 3;   // ... doubled by each probe missed, this many times at most
  double estimate(size_t depth) const;    // P(tokens 0..depth all accepted)
  void observe(size_t drafted, size_t accepted);
  void pass_over();  // a row offered the model's chain was not sent it
  void offer();      // a row was offered the model's chain (sent or not)
  bool judged() const { return offered >= kColdAfter; }  // enough rows of its own to tell whether it is cold
  bool cold() const { return judged() && (won * kColdAfter < offered || worth < spent); }
  uint64_t probe_interval() const { return kProbeEvery << std::min(missed_probes, kMaxBackoff); }
  // whether the drafter follows a request starting on this stage, `cold` as judged (its own or pooled)
  bool follow_new_request(bool cold);
  // counts times num / den, rounded down (depth by depth, so that no depth is reached more often
  // than it was tried or than the depth before)
  void scale(uint64_t num, uint64_t den);
};

// One step's input, as vLLM's InputBatch holds it: row i of `rows` (row stride `stride`) holds
// request i's tokens, `num_tokens[i]` of them valid (this step's sampled tokens included);
// `sampled` holds every request's sampled tokens back to back, request i's from
// `sampled_offsets[i]` to `sampled_offsets[i + 1]` (none: a partial prefill, no draft).
struct BatchStep {
  const std::vector<std::string>* rids;  // "" for an empty slot
  const int32_t* rows;
  size_t stride;
  const int32_t* num_tokens;
  const int32_t* sampled;
  const int64_t* sampled_offsets;
  int max_tokens;     // most draft tokens this step
  int max_model_len;  // a draft never runs past it
  int64_t scheduled = -1;  // tokens the step that just ran computed (vLLM's scheduler output; -1: unknown)
  // The hybrid: a model drafter's chain for each request (vLLM's EAGLE head or draft model, run
  // beside the trees), request i's from model_offsets[i] to model_offsets[i + 1] of model_tokens.
  // Each request is sent whichever of its trees' draft and the model's chain expects more accepted
  // tokens, cut by the budget like any candidate. Null: no model this step. The choice reads only
  // the chains' lengths (each token is priced by its stage's record, not by what it is), so a
  // drafter may pass placeholders and fill in the rows sent its chain after the step
  // (`model_passes`: the longest of them), running only the passes those need.
  const int32_t* model_tokens = nullptr;
  const int64_t* model_offsets = nullptr;
};

// One timed step of the serving engine: what it computed and how long it took, from the start of
// one proposer call to the start of the next, less the proposer's own time. The step cost model
// (agentaccel/engine/step_cost.py) is fitted to these.
struct StepTiming {
  double tokens = 0;         // tokens computed (the scheduler's count; else the decoding requests' 1 + drafts)
  double decode_tokens = 0;  // of which the decoding requests' 1 + draft (the rest: prefill)
  double context = 0;        // context tokens of the step's requests
  double attention = 0;      // sum over decoding requests of (1 + draft) x context
  double seconds = 0;        // the step, without the proposer
  double proposer_seconds = 0;  // the proposer call that drafted for it
  uint32_t requests = 0;     // rows of the step
  uint32_t drafter_passes = 0;  // the hybrid's model drafter's forward passes since the last step (0: none ran)
  double drafter_seconds = 0;   // ... and their time, left out of `seconds` (the step cost is the target's alone)
};

class BatchDrafter {
 public:
  // `threads`: drafting threads including the caller's (1: all on the caller's thread). Each
  // request drafts with its stage's policy, which the engine holds.
  BatchDrafter(Engine& engine, int threads);
  ~BatchDrafter();
  BatchDrafter(const BatchDrafter&) = delete;
  BatchDrafter& operator=(const BatchDrafter&) = delete;

  // Announces a request before its first step: its stage, whether it is drafted for (a request
  // that is not is a baseline: no drafts, and its output is not learned from), and the most tokens
  // it may hold, prompt included (-1: no limit but max_model_len): no draft runs past it.
  void admit(const std::string& rid, const std::string& stage, bool speculate, int64_t max_total_tokens = -1);
  // A request left the batch (finished, aborted or preempted): its tree is freed now and its
  // output queued for its stage tree. Requests a step no longer lists are released the same way.
  void release(const std::string& rid);
  std::vector<std::vector<uint32_t>> step(const BatchStep& step);
  std::map<std::string, StageCounters> counters() const;
  // Drafts for the batch as a whole under this model of a step's cost (see step_budget.h): every
  // request's candidate is grown with its stage's policy, then cut so that the step gives the most
  // tokens per second. An empty model: each request's policy sizes its own draft alone.
  void set_step_cost(StepCost cost);
  StepCost step_cost() const;
  // The steps timed since the last call (at most kMaxTimings are kept).
  std::vector<StepTiming> drain_timings();
  uint64_t proposer_ns() const { return proposer_ns_.load(std::memory_order_relaxed); }  // time in step(), all steps
  uint64_t steps() const { return steps_.load(std::memory_order_relaxed); }
  // The last step's budget candidates by row: each token's D before the budget cut it (empty where
  // none was grown, and every row without a step cost): what a simulated ceiling re-allocates.
  std::vector<std::vector<double>> candidate_probs() const;
  // The last step's drafts by row: true where the model's chain was sent (the hybrid).
  std::vector<bool> model_rows() const;
  // The hybrid: the last step's rows by whether the model drafter follows their request (writes
  // its positions into its KV cache, and may be sent its chains; ModelRecord's cold stages).
  std::vector<bool> followed_rows() const;
  // The hybrid's drafter runs no pass on a step that sends no chain (its cost is then a choice):
  // only then does it follow some requests of a cold stage and not others; running every step,
  // it writes every request's positions anyway, and every request is offered its chains.
  void set_drafter_skips(bool skips) { drafter_skips_.store(skips, std::memory_order_relaxed); }
  // The hybrid: the last step's longest model chain sent, the tokens its drafter must draft for the
  // batch (0: none sent; vLLM's EAGLE still runs one pass to keep its KV cache in step).
  size_t model_passes() const;
  // The hybrid: the forward passes its model drafter ran after the last step and their time (the
  // next step's timing counts them apart from the target's step).
  void drafter_ran(uint32_t passes, double seconds);
  // The hybrid under a step budget: its model drafter's passes, as shares of the batch's plain
  // step (0: not priced). `further`: each pass past the first, which must gain what it costs.
  // `first`: the first pass, where a step that sends no chain runs none (its skipped positions
  // caught up in the next first pass): the chains of a step must together gain it, or none is sent
  // and their rows get the trees' drafts back. 0 where the first pass runs every step anyway.
  void set_drafter_pass_cost(double first, double further);
  std::pair<double, double> drafter_pass_cost() const {
    return {drafter_first_share_.load(std::memory_order_relaxed), drafter_pass_share_.load(std::memory_order_relaxed)};
  }
  // Per stage: what the model drafter's chains got accepted (a restart starts from a kept record).
  std::map<std::string, ModelRecord> model_records() const;
  // Starts a stage's record from a kept one; false (nothing kept) for a new stage past kMaxCountedStages.
  bool set_model_record(const std::string& stage, ModelRecord record);
  size_t tracked() const;  // requests the drafter knows (admitted, not yet finished)
  size_t pending_outputs() const;  // finished outputs waiting to join their stage trees

 private:
  struct Entry {
    std::string stage;
    bool speculate = true;
    int64_t max_total_tokens = -1;  // prompt + most output tokens (-1: unknown)
    bool started = false;     // has an engine request
    size_t prompt_len = 0;    // its context when it started (the output follows)
    int32_t last_draft = -1;  // length of the draft proposed last step (-1: none yet)
    double last_score = 0.0;  // its expected accepted tokens
    bool last_model = false;  // the draft proposed last step was the model drafter's chain
    bool followed = true;     // the hybrid: the model drafter follows it (decided when first listed)
    bool probe = false;       // ... as one of a cold stage's few (ModelRecord::missed_probes)
    int32_t written = 0;      // ... its positions the drafter's passes have covered (ModelRecord::spent)
    uint64_t seen = 0;        // the last step that listed it (or, before any, the step it was admitted at)
    uint64_t listed = 0;      // the last step that listed it (0: none yet)
    StageCounters* counters = nullptr;
  };
  struct Job {  // one request's drafting in the current step
    size_t index;  // its row in the batch
    const std::string* rid;
    Entry* entry;
    int budget;
    double floor = 0.0;       // with a step cost: the candidate grows while confidence x D exceeds it
    double context = 0.0;     // tokens its queries attend over next step
    double confidence = 1.0;  // the trust its stage's policy gives its estimates
    Draft candidate;          // with a step cost: the grown draft before the budget cuts it
    Draft tree;                         // the hybrid: the trees' candidate when the model's was preferred
    std::vector<uint32_t> model;        // the hybrid: the model's chain for this row (cut to `budget`)
    std::vector<double> model_probs;    // its tokens' D from the stage's model record
    bool use_model = false;             // the model's chain was chosen over the trees' draft
    bool offered = false;               // the model offered a chain for this row (sent or not)
  };

  // What reading a step's rows found: the step that just ran (its timing and the drafts it
  // verified) and the one to come (what its budget prices).
  struct StepScan {
    StepTiming timed;        // the step that just ran
    bool continued = false;  // one of its requests was in the step before: the engine ran without a pause
    size_t decoding = 0;     // requests that yield a token next step
    size_t listed = 0;       // requests in the next step (decoding or prefilling)
    double drafted_tokens = 0.0, drafted_attention = 0.0;  // the step's draft tokens, and their attention work
    double next_context = 0.0, next_attention = 0.0;       // the next step's context and attention work
    // requests whose draft the step verified: their stage's counters and accepted tokens (what
    // speculation saved them is priced once the whole step is known)
    std::vector<std::pair<StageCounters*, double>>* verified = nullptr;
  };

  // A step's parts, in order: the bookkeeping of its rows (their requests started, extended and
  // credited with what their last drafts got accepted, a job per request to draft for); the time
  // saved priced; the budget's floors; the drafting; the drafts noted; absent requests retired.
  StepScan scan_rows(const BatchStep& s);
  int64_t count_verified(Entry& e, int64_t sampled);  // the last draft's accepted tokens, counted
  void add_job(const BatchStep& s, size_t i, const std::string& rid, Entry& e, int budget, double context);
  void credit_saved(const StepCost& cost, const StepScan& scan);
  void set_floors(const StepCost& cost, const StepScan& scan, bool hybrid);
  void run_jobs(std::vector<std::vector<uint32_t>>& out);  // on the pool when there are enough
  void note_drafts(const std::vector<std::vector<uint32_t>>& out);
  void retire_absent();
  void draft_range(std::vector<std::vector<uint32_t>>& out);
  // The hybrid's choice for one job: the model's chain where it expects more accepted tokens than
  // the trees' draft (`tree_score`) does.
  static bool prefer_model(const Job& j, double tree_score);
  void record_timing(StepTiming timed, std::chrono::steady_clock::time_point started);
  void spend_budget(const StepCost& cost, size_t decoding, double context, double attention, double rows,
                    std::vector<std::vector<uint32_t>>& out);
  // Cuts the model chains sent back to the passes that pay for themselves (the budget's drafts):
  // none where their first tokens do not pay for the first pass (its price set), the trees'
  // drafts back in their rows; then the passes after it, deepest first.
  void price_drafter_passes(double decoding, std::vector<std::vector<uint32_t>>& out);
  void send_no_chain(std::vector<std::vector<uint32_t>>& out);
  void retire(const std::string& rid, const Entry& e);  // frees the engine request, queues its output
  void flush();  // adds the pending outputs to their stage trees
  void worker_loop();

  Engine& engine_;
  std::unordered_map<std::string, Entry> entries_;
  std::map<std::string, StageCounters> counters_;
  std::map<std::string, ModelRecord> model_records_;  // by stage (under counters_mu_): kMaxCountedStages, then kOtherStages
  // A stage's record (under counters_mu_); past kMaxCountedStages stages the rest share kOtherStages'.
  // A new stage's is made only when `make` (a chain was verified); otherwise null: the prior.
  ModelRecord* record_of(const std::string& stage, bool make);
  void charge_drafter(double seconds);  // what the drafter's run after the last step took, by stage (under admit_mu_)
  // Whether a stage is cold: by its own record once judged, else by the pooled one (under counters_mu_).
  bool stage_cold(const ModelRecord* own) const { return own && own->judged() ? own->cold() : pooled_.cold(); }
  ModelRecord pooled_;  // the head over every stage: its rows offered and tokens won (under counters_mu_)
  static constexpr size_t kMaxCountedStages = 512;  // as the proxy's metrics: stage names are client-chosen
  static constexpr const char* kOtherStages = "other";
  mutable std::mutex counters_mu_;  // counters_ are read by a stats thread while steps run
  mutable std::mutex admit_mu_;     // admit() may come from another thread than step()
  uint64_t step_no_ = 0;
  std::vector<std::pair<std::string, std::vector<uint32_t>>> pending_;  // finished outputs, by stage

  // The step cost model (set by another thread) and the timing of steps.
  mutable std::mutex cost_mu_;
  std::shared_ptr<const StepCost> cost_;
  std::mutex timings_mu_;
  std::vector<StepTiming> timings_;
  static constexpr size_t kMaxTimings = 8192;
  std::chrono::steady_clock::time_point last_start_{}, last_end_{};
  bool timed_before_ = false;
  bool budgeted_ = false;  // this step drafts candidates for the budget (read by the pool's threads)
  uint32_t drafter_passes_ = 0;  // forward passes the hybrid's drafter ran after the last step (0: none)
  double drafter_seconds_ = 0.0;  // ... and their time
  size_t last_model_rows_ = 0;    // rows the last step sent the model's chain
  size_t last_model_passes_ = 0;  // ... and the longest chain among them (model_passes)
  double pass_floor_ = 0.0;       // this step: the D a model token past the first must reach (its pass's share)
  // The hybrid, what prices a stage's drafter passes and chains (ModelRecord::spent, worth): the
  // last step's followed requests with their tokens then, its plain step in seconds (0: not known
  // in seconds) and its rows decoding.
  std::vector<std::pair<std::string, int32_t>> last_followed_;
  double last_plain_seconds_ = 0.0;
  size_t last_decoding_ = 0;
  std::atomic<double> drafter_pass_share_{0.0};  // one more drafter pass, in plain steps of the batch
  std::atomic<double> drafter_first_share_{0.0};  // its first pass where a step may skip it (0: never skipped)
  std::atomic<bool> drafter_skips_{false};  // set_drafter_skips
  std::atomic<uint64_t> proposer_ns_{0}, steps_{0};

  // Drafting pool: the caller bumps `generation_`, every thread takes jobs from `next_job_`.
  std::vector<Job> jobs_;
  size_t rows_ = 0;  // rows of the last step
  std::vector<bool> followed_;  // the last step's rows: the model drafter follows its request
  std::vector<std::vector<uint32_t>>* out_ = nullptr;
  std::vector<std::thread> workers_;
  std::mutex pool_mu_;
  std::condition_variable pool_cv_, done_cv_;
  uint64_t generation_ = 0;
  size_t busy_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;  // the first drafting error of a step, rethrown by step()
  std::atomic<size_t> next_job_{0};
};

}  // namespace agentaccel
