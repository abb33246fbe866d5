// Python bindings (module agentaccel._core). Every call that touches the index releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "batch_drafter.h"
#include "engine.h"
#include "errors.h"
#include "step_budget.h"
#include "template_lines.h"

namespace nb = nanobind;
using namespace nb::literals;
using agentaccel::BatchDrafter;
using agentaccel::Draft;
using agentaccel::Engine;
using agentaccel::SpecParams;

using Tokens = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Release = nb::call_guard<nb::gil_scoped_release>;
using Rows = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Counts = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One step of BatchDrafter: the Python lists are read with the GIL held, the drafting runs without it.
static std::vector<std::vector<uint32_t>> batch_step(BatchDrafter& d, nb::list rids, Rows rows, Counts num_tokens,
                                                     nb::list sampled, int max_tokens, int max_model_len,
                                                     int64_t scheduled, nb::object model_chains) {
  const size_t n = nb::len(sampled);
  if (nb::len(rids) < n || rows.shape(0) < n || num_tokens.shape(0) < n)
    throw agentaccel::InvalidInput("req_ids, rows and num_tokens need a row for every sampled list");
  std::vector<std::string> ids(n);
  std::vector<int32_t> flat;
  std::vector<int64_t> offsets(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    nb::handle rid = rids[i];
    if (!rid.is_none()) ids[i] = nb::cast<std::string>(rid);
    for (nb::handle t : sampled[i]) flat.push_back(nb::cast<int32_t>(t));
    offsets[i + 1] = int64_t(flat.size());
  }
  agentaccel::BatchStep step{&ids,      rows.data(), rows.shape(1), num_tokens.data(), flat.data(),
                             offsets.data(), max_tokens, max_model_len, scheduled};
  std::vector<int32_t> model_flat;  // the hybrid's model chains, one list per row (None: no model)
  std::vector<int64_t> model_offsets;
  if (nb::isinstance<nb::int_>(model_chains)) {  // every row's chain this long, its tokens filled in after
    const int64_t k = nb::cast<int64_t>(model_chains);
    if (k < 0) throw agentaccel::InvalidInput("a model chain's length must be >= 0");
    model_flat.assign(n * size_t(k) + 1, 0);  // one past the chains: never null, even with none
    model_offsets.resize(n + 1);
    for (size_t i = 0; i <= n; ++i) model_offsets[i] = int64_t(i) * k;
    step.model_tokens = model_flat.data();
    step.model_offsets = model_offsets.data();
  } else if (!model_chains.is_none()) {
    nb::list chains = nb::cast<nb::list>(model_chains);
    if (nb::len(chains) < n) throw agentaccel::InvalidInput("model_chains needs a chain (possibly empty) for every row");
    model_offsets.assign(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      for (nb::handle t : chains[i]) {
        const int32_t token = nb::cast<int32_t>(t);
        if (token < 0) throw agentaccel::InvalidInput("a model chain's tokens must be >= 0");
        model_flat.push_back(token);
      }
      model_offsets[i + 1] = int64_t(model_flat.size());
    }
    model_flat.push_back(0);  // one past the chains: never null, even with none
    step.model_tokens = model_flat.data();
    step.model_offsets = model_offsets.data();
  }
  nb::gil_scoped_release release;
  return d.step(step);
}

// The step budget over plain lists (tests, experiments): the allocation BatchDrafter runs each step.
static std::vector<int32_t> allocate(const std::vector<std::vector<double>>& probs, const std::vector<double>& confidence,
                                     const std::vector<double>& contexts, size_t decoding, double context,
                                     double attention, double rows, agentaccel::StepCost cost) {
  if (confidence.size() != probs.size() || contexts.size() != probs.size())
    throw agentaccel::InvalidInput("probs, confidence and contexts need one entry per request");
  cost.validate();
  cost.prepare();
  std::vector<agentaccel::BudgetRequest> requests(probs.size());
  for (size_t i = 0; i < probs.size(); ++i) requests[i] = {probs[i].data(), probs[i].size(), confidence[i], contexts[i]};
  std::vector<int32_t> keep;
  {
    nb::gil_scoped_release release;
    agentaccel::allocate_budget(requests, decoding, context, attention, rows, cost, keep);
  }
  return keep;
}

NB_MODULE(_core, m) {
  m.doc() = "agentaccel native suffix engine";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const agentaccel::UnknownKey& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const agentaccel::InvalidInput& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.attr("REQUEST_TREE") = int(agentaccel::kRequestTree);
  m.attr("STAGE_TREE") = int(agentaccel::kStageTree);
  m.attr("UNION_TREE") = int(agentaccel::kUnionTree);

  nb::class_<Draft>(m, "Draft")
      .def_ro("token_ids", &Draft::tokens)
      .def_ro("parents", &Draft::parents)
      .def_ro("probs", &Draft::probs)
      .def_ro("score", &Draft::score)
      .def_ro("match_len", &Draft::match_len)
      .def_ro("source", &Draft::source)
      .def("__len__", [](const Draft& d) { return d.tokens.size(); })
      .def("__repr__", [](const Draft& d) {
        return "Draft(" + std::to_string(d.tokens.size()) + " tokens, score=" + std::to_string(d.score) +
               ", match_len=" + std::to_string(d.match_len) + ", source='" + d.source + "')";
      });

  nb::class_<SpecParams>(m, "SpecParams")
      .def(nb::init<>())
      .def_rw("max_tokens", &SpecParams::max_tokens)
      .def_rw("mixture", &SpecParams::mixture)
      .def_rw("alpha", &SpecParams::alpha)
      .def_rw("max_pattern", &SpecParams::max_pattern)
      .def_rw("min_prob", &SpecParams::min_prob)
      .def_rw("min_score", &SpecParams::min_score)
      .def_rw("tree", &SpecParams::tree)
      .def_rw("trees", &SpecParams::trees)
      .def_rw("cost", &SpecParams::cost)
      .def_rw("max_sources", &SpecParams::max_sources)
      .def_rw("length_power", &SpecParams::length_power)
      .def_rw("escape", &SpecParams::escape)
      .def_rw("escape_length", &SpecParams::escape_length)
      .def_rw("recency", &SpecParams::recency)
      .def_rw("confidence", &SpecParams::confidence)
      .def_rw("curve_contexts", &SpecParams::curve_contexts)
      .def_rw("curve_costs", &SpecParams::curve_costs);

  nb::class_<agentaccel::Predictability>(m, "Predictability")
      .def_ro("positions", &agentaccel::Predictability::positions)
      .def_ro("covered", &agentaccel::Predictability::covered)
      .def_ro("entropy_bits", &agentaccel::Predictability::entropy_bits)
      .def_ro("top1_hits", &agentaccel::Predictability::top1_hits);

  nb::class_<agentaccel::StageStats>(m, "StageStats")
      .def_ro("name", &agentaccel::StageStats::name)
      .def_ro("tokens", &agentaccel::StageStats::tokens)
      .def_ro("documents", &agentaccel::StageStats::documents)
      .def_ro("bytes", &agentaccel::StageStats::bytes)
      .def_ro("states", &agentaccel::StageStats::states)
      .def_ro("edges", &agentaccel::StageStats::edges);

  nb::class_<agentaccel::StageCounters>(m, "StageCounters")
      .def_ro("steps", &agentaccel::StageCounters::steps)
      .def_ro("drafted_steps", &agentaccel::StageCounters::drafted_steps)
      .def_ro("drafted", &agentaccel::StageCounters::drafted)
      .def_ro("accepted", &agentaccel::StageCounters::accepted)
      .def_ro("tokens", &agentaccel::StageCounters::tokens)
      .def_ro("predicted", &agentaccel::StageCounters::predicted)
      .def_ro("saved_seconds", &agentaccel::StageCounters::saved_seconds)
      .def_ro("model_drafted_steps", &agentaccel::StageCounters::model_drafted_steps)
      .def_ro("model_drafted", &agentaccel::StageCounters::model_drafted)
      .def_ro("model_accepted", &agentaccel::StageCounters::model_accepted)
      .def_ro("model_predicted", &agentaccel::StageCounters::model_predicted)
      .def_ro("model_unfollowed", &agentaccel::StageCounters::model_unfollowed);

  nb::class_<agentaccel::ModelRecord>(m, "ModelRecord")
      .def(nb::init<>())
      .def_rw("tried", &agentaccel::ModelRecord::tried)
      .def_rw("reached", &agentaccel::ModelRecord::reached)
      .def("estimate", &agentaccel::ModelRecord::estimate, "depth"_a)
      .def_ro("passed", &agentaccel::ModelRecord::passed)
      .def_ro("offered", &agentaccel::ModelRecord::offered)
      .def_ro("won", &agentaccel::ModelRecord::won)
      .def_ro("worth", &agentaccel::ModelRecord::worth)
      .def_ro("spent", &agentaccel::ModelRecord::spent)
      .def_ro("missed_probes", &agentaccel::ModelRecord::missed_probes)
      .def("judged", &agentaccel::ModelRecord::judged)
      .def("cold", &agentaccel::ModelRecord::cold)
      .def("probe_interval", &agentaccel::ModelRecord::probe_interval)
      .def("observe", &agentaccel::ModelRecord::observe, "drafted"_a, "accepted"_a)
      .def("pass_over", &agentaccel::ModelRecord::pass_over)
      .def_ro_static("horizon", &agentaccel::ModelRecord::kHorizon)
      .def_ro_static("fade_after", &agentaccel::ModelRecord::kFadeAfter)
      .def_ro_static("cold_after", &agentaccel::ModelRecord::kColdAfter)
      .def_ro_static("cold_window", &agentaccel::ModelRecord::kColdWindow)
      .def_ro_static("probe_every", &agentaccel::ModelRecord::kProbeEvery)
      .def_ro_static("max_backoff", &agentaccel::ModelRecord::kMaxBackoff);

  nb::class_<agentaccel::StepCost>(m, "StepCost")
      .def(nb::init<>())
      .def_rw("base", &agentaccel::StepCost::base)
      .def_rw("per_context", &agentaccel::StepCost::per_context)
      .def_rw("per_attention", &agentaccel::StepCost::per_attention)
      .def_rw("per_request", &agentaccel::StepCost::per_request)
      .def_rw("prefill_tokens", &agentaccel::StepCost::prefill_tokens)
      .def_rw("prefill_share", &agentaccel::StepCost::prefill_share)
      .def_rw("in_seconds", &agentaccel::StepCost::in_seconds)
      .def("at", &agentaccel::StepCost::at, "tokens"_a);

  nb::class_<agentaccel::StepTiming>(m, "StepTiming")
      .def_ro("tokens", &agentaccel::StepTiming::tokens)
      .def_ro("decode_tokens", &agentaccel::StepTiming::decode_tokens)
      .def_ro("context", &agentaccel::StepTiming::context)
      .def_ro("attention", &agentaccel::StepTiming::attention)
      .def_ro("seconds", &agentaccel::StepTiming::seconds)
      .def_ro("proposer_seconds", &agentaccel::StepTiming::proposer_seconds)
      .def_ro("requests", &agentaccel::StepTiming::requests)
      .def_ro("drafter_passes", &agentaccel::StepTiming::drafter_passes)
      .def_ro("drafter_seconds", &agentaccel::StepTiming::drafter_seconds);

  m.def("line_hashes", &agentaccel::line_hashes, "text"_a, "max_bytes"_a);
  m.def("masked_lines", &agentaccel::masked_lines, "text"_a, "max_bytes"_a);

  m.def("allocate_budget", &allocate, "probs"_a, "confidence"_a, "contexts"_a, "decoding"_a, "context"_a,
        "attention"_a, "rows"_a, "cost"_a);

  nb::class_<BatchDrafter>(m, "BatchDrafter")
      .def(nb::init<Engine&, int>(), "engine"_a, "threads"_a, nb::keep_alive<1, 2>())
      .def("admit", &BatchDrafter::admit, "req_id"_a, "stage"_a, "speculate"_a, "max_total_tokens"_a = -1, Release())
      .def("release", &BatchDrafter::release, "req_id"_a, Release())
      .def("step", &batch_step, "req_ids"_a, "rows"_a, "num_tokens"_a, "sampled"_a, "max_tokens"_a, "max_model_len"_a,
           "scheduled"_a = -1, "model_chains"_a = nb::none())
      .def("set_step_cost", &BatchDrafter::set_step_cost, "cost"_a, Release())
      .def("step_cost", &BatchDrafter::step_cost, Release())
      .def("drain_timings", &BatchDrafter::drain_timings, Release())
      .def("proposer_ns", &BatchDrafter::proposer_ns)
      .def("steps", &BatchDrafter::steps)
      .def("counters", &BatchDrafter::counters, Release())
      .def("tracked", &BatchDrafter::tracked, Release())
      .def("pending_outputs", &BatchDrafter::pending_outputs, Release())
      .def("candidate_probs", &BatchDrafter::candidate_probs, Release())
      .def("model_rows", &BatchDrafter::model_rows, Release())
      .def("followed_rows", &BatchDrafter::followed_rows, Release())
      .def("set_drafter_skips", &BatchDrafter::set_drafter_skips, "skips"_a)
      .def("model_passes", &BatchDrafter::model_passes, Release())
      .def("drafter_ran", &BatchDrafter::drafter_ran, "passes"_a, "seconds"_a, Release())
      .def("set_drafter_pass_cost", &BatchDrafter::set_drafter_pass_cost, "first"_a, "further"_a, Release())
      .def("drafter_pass_cost", &BatchDrafter::drafter_pass_cost)
      .def("model_records", &BatchDrafter::model_records, Release())
      .def("set_model_record", &BatchDrafter::set_model_record, "stage"_a, "record"_a, Release());

  nb::class_<Engine>(m, "Engine")
      .def(nb::init<int, uint64_t, double>(), "max_depth"_a, "memory_budget_bytes"_a, "evict_slack"_a)
      .def("add_peer_document",
           [](Engine& e, const std::string& stage, Tokens t) {
             return e.add_peer_document(stage, t.data(), t.shape(0));
           },
           "stage"_a, "tokens"_a, Release())
      .def("add_document",
           [](Engine& e, const std::string& stage, Tokens t) { return e.add_document(stage, t.data(), t.shape(0)); },
           "stage"_a, "tokens"_a, Release())
      .def("remove_document", &Engine::remove_document, "doc_id"_a, Release())
      .def("document_ids", &Engine::document_ids, "stage"_a, Release())
      .def("start_request",
           [](Engine& e, const std::string& rid, Tokens t, const std::string& stage, const std::string& from) {
             return e.start_request(rid, t.data(), t.shape(0), stage, from);
           },
           "req_id"_a, "prompt"_a, "stage"_a, "continue_from"_a, Release())
      .def("extend", [](Engine& e, const std::string& rid, Tokens t) { e.extend(rid, t.data(), t.shape(0)); },
           "req_id"_a, "tokens"_a, Release())
      .def("speculate", &Engine::speculate, "req_id"_a, "max_tokens"_a, Release())
      .def("speculate_with", &Engine::speculate_with, "req_id"_a, "params"_a, Release())
      .def("speculate_candidate",
           [](Engine& e, const std::string& rid, int max_tokens, double floor) {
             double confidence = 1.0;
             Draft d = e.speculate_candidate(rid, max_tokens, floor, &confidence);
             return std::make_pair(std::move(d), confidence);
           },
           "req_id"_a, "max_tokens"_a, "floor"_a, Release())
      .def("set_policy", &Engine::set_policy, "stage"_a, "params"_a, Release())
      .def("clear_policy", &Engine::clear_policy, "stage"_a, Release())
      .def("policy", &Engine::policy, "stage"_a, Release())
      .def("finish_request", &Engine::finish_request, "req_id"_a, "keep_output"_a, "retain"_a, Release())
      .def("prompt_lookup", &Engine::prompt_lookup, "req_id"_a, "min_n"_a, "max_n"_a, "k"_a, Release())
      .def("longest_continuation",
           [](Engine& e, const std::string& rid, int k, Tokens t) { return e.longest_continuation(rid, k, t.data(), t.shape(0)); },
           "req_id"_a, "k"_a, "continuation"_a, Release())
      .def("request_tokens", &Engine::request_tokens, "req_id"_a, Release())
      .def("has_request", &Engine::has_request, "req_id"_a, Release())
      .def("stage_stats", &Engine::stage_stats, Release())
      .def("global_bytes", &Engine::global_bytes, Release())
      .def("compact", &Engine::compact, Release())
      .def("predictability",
           [](const Engine& e, const std::string& stage, Tokens t) { return e.predictability(stage, t.data(), t.shape(0)); },
           "stage"_a, "tokens"_a, Release())
      .def("request_bytes", &Engine::request_bytes, Release())
      .def("num_requests", &Engine::num_requests, Release())
      .def("evicted_documents", &Engine::evicted_documents)
      .def_prop_rw("recency_half_life", &Engine::recency_half_life, &Engine::set_recency_half_life)
      .def_prop_ro("max_depth", &Engine::max_depth)
      .def_prop_ro("memory_budget", &Engine::memory_budget)
      .def("check", &Engine::check, "counts"_a, Release())
      .def("save", &Engine::save, "path"_a, Release())
      .def_static("load", &Engine::load, "path"_a, Release());
}
