// Draft-tree growth over one or more automaton states.
//
// Paper mode (SuffixDecoding): the states' counts are summed (the union of trees behaves as one
// tree), D(child) = D(parent) * COUNT(child) / sum COUNT(siblings), nodes are added greedily by D
// until MAX_SPEC nodes or D < min_prob. Mixture mode (agentaccel): every state is a separate
// source of evidence (another match length or another tree) with a prior weight; a child's
// probability is the weighted mean of the sources' next-token distributions and the weights
// are updated by Bayes' rule along each path; growth stops when a node's expected gain no
// longer pays for its verification cost (DySpec-style budgeted greedy growth).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "automaton.h"

namespace agentaccel {

struct Draft {
  std::vector<uint32_t> tokens;   // draft token ids, in the order they were added
  std::vector<int32_t> parents;   // index of each node's parent in `tokens`; -1 follows the context
  std::vector<double> probs;      // D(N): estimated probability that the node is accepted
  double score = 0.0;             // sum of probs (expected accepted draft tokens)
  int32_t match_len = 0;          // length of the context suffix the draft was grown from
  std::string source;             // "request", "stage", "union", "mixture" or "" when empty
};

struct Source {
  const Automaton* automaton;
  uint32_t state;
  double weight;        // prior weight (mixture mode); ignored in paper mode
  int32_t matched = 0;  // context tokens this source has matched so far (mixture calibration)
};

// Built by the engine from SpecParams, every field set.
struct GrowLimits {
  int budget = 0;              // most nodes in the draft
  int room = 0;                // deepest node depth allowed (max_depth - pattern length in paper mode)
  double min_prob = 0.0;       // nodes with D below this are never added
  double cost = 0.0;           // mixture mode: verification cost of one draft token, in steps
  double escape = 0.0;         // mixture mode: PPM-style escape mass per distinct child (calibration)...
  double escape_length = 0.0;  // ...divided by (1 + matched / escape_length) when > 0: long exact
                               // matches predict their continuation better than short ones
  double recency = 0.0;        // mixture mode: share of a request tree's recency-weighted counts in
                               // its continuations' counts (0: plain counts; needs trees with recency)
  double confidence = 0.0;     // mixture mode: growth weighs each node's D by this (SpecParams::confidence)
  bool fixed_threshold = false;  // mixture mode: a node is added while confidence x D > cost (a step-wide
                                 // budget's floor: it cuts the draft itself) instead of the request's rate rule
  bool tree = false;           // false: a single path (linear draft)
  bool mixture = false;        // false: paper mode (summed counts)
};

// Grows a draft from `roots` into `out` (whose buffers are reused). `room_hit` reports whether
// the depth limit cut off a candidate (the engine then cannot reuse the draft for shorter
// patterns of the same state).
void grow_draft(const std::vector<Source>& roots, const GrowLimits& limits, bool* room_hit, Draft& out);

}  // namespace agentaccel
