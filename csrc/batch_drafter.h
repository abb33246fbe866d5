// Drafts for every request of one inference step in a single call (vLLM's proposer): starts
// the requests it has not seen, appends each one's newly sampled tokens, drafts, finishes the
// requests that left the batch, and counts draft statistics per stage. Drafting itself runs on
// a small pool of threads when the batch is large enough to pay for the hand-off.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.h"

namespace agentaccel {

struct StageCounters {
  uint64_t steps = 0;     // verification steps of a draft proposed the step before
  uint64_t drafted = 0;   // draft tokens those steps verified
  uint64_t accepted = 0;  // draft tokens accepted
  uint64_t tokens = 0;    // tokens produced (accepted + the one the model adds each step)
  double predicted = 0.0; // expected accepted tokens of those drafts (sum of their scores)
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
};

class BatchDrafter {
 public:
  // `threads`: drafting threads including the caller's (1: all on the caller's thread). Each
  // request drafts with its stage's policy, which the engine holds.
  BatchDrafter(Engine& engine, int threads);
  ~BatchDrafter();
  BatchDrafter(const BatchDrafter&) = delete;
  BatchDrafter& operator=(const BatchDrafter&) = delete;

  // Announces a request before its first step: its stage, and whether it is drafted for (a
  // request that is not is a baseline: no drafts, and its output is not learned from).
  void admit(const std::string& rid, const std::string& stage, bool speculate);
  // A request left the batch (finished, aborted or preempted): its tree is freed now and its
  // output queued for its stage tree. Requests a step no longer lists are released the same way.
  void release(const std::string& rid);
  std::vector<std::vector<uint32_t>> step(const BatchStep& step);
  std::map<std::string, StageCounters> counters() const;
  size_t tracked() const;  // requests the drafter knows (admitted, not yet finished)
  size_t pending_outputs() const;  // finished outputs waiting to join their stage trees

 private:
  struct Entry {
    std::string stage;
    bool speculate = true;
    bool started = false;     // has an engine request
    size_t prompt_len = 0;    // its context when it started (the output follows)
    int32_t last_draft = -1;  // length of the draft proposed last step (-1: none yet)
    double last_score = 0.0;  // its expected accepted tokens
    uint64_t seen = 0;        // the last step that listed it
    StageCounters* counters = nullptr;
  };
  struct Job {  // one request's drafting in the current step
    size_t index;  // its row in the batch
    const std::string* rid;
    Entry* entry;
    int budget;
  };

  void draft_range(std::vector<std::vector<uint32_t>>& out);
  void retire(const std::string& rid, const Entry& e);  // frees the engine request, queues its output
  void flush();  // adds the pending outputs to their stage trees
  void worker_loop();

  Engine& engine_;
  std::unordered_map<std::string, Entry> entries_;
  std::map<std::string, StageCounters> counters_;
  static constexpr size_t kMaxCountedStages = 512;  // as the proxy's metrics: stage names are client-chosen
  static constexpr const char* kOtherStages = "other";
  mutable std::mutex counters_mu_;  // counters_ are read by a stats thread while steps run
  mutable std::mutex admit_mu_;     // admit() may come from another thread than step()
  uint64_t step_no_ = 0;
  uint64_t last_flush_ = 0;
  std::vector<std::pair<std::string, std::vector<uint32_t>>> pending_;  // finished outputs, by stage

  // Drafting pool: the caller bumps `generation_`, every thread takes jobs from `next_job_`.
  std::vector<Job> jobs_;
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
