#include "drafter.h"

#include <algorithm>
#include <queue>

namespace agentaccel {

namespace {

struct Kid {
  uint32_t token;
  uint64_t count;      // paper mode: summed COUNT (ties and order use it exactly)
  double p;            // probability given the parent
  uint32_t src_begin;  // the kid's sources in the pool
  uint32_t src_end;
};

struct Node {
  int32_t draft_index;  // -1 for the root (the matched context suffix)
  int32_t depth;
  double d;
  uint32_t kid_begin = 0;  // its kids in the kid pool: sorted best first, only those that can pass min_prob
  uint32_t kid_end = 0;
  uint32_t next_kid = 0;   // absolute index of the next kid not yet drafted
};

struct Candidate {
  double d;
  int32_t parent_index;  // draft index of the parent (-1: root)
  uint32_t token;
  uint32_t node;         // slot of the parent in `nodes`
};

// Highest D first; ties: lower parent draft index, then lower token id (the reference's order).
struct Worse {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.d != b.d) return a.d < b.d;
    if (a.parent_index != b.parent_index) return a.parent_index > b.parent_index;
    return a.token > b.token;
  }
};

struct Entry {
  uint32_t token;
  uint32_t source;  // index into the parent's sources
  uint32_t target;
  uint32_t count;
};

// Buffers reused across calls on the same thread (drafting allocates nothing once warm).
struct Scratch {
  std::vector<Node> nodes;
  std::vector<Kid> kids;
  std::vector<Source> pool;
  std::vector<Entry> entries;
  std::vector<uint64_t> totals;
  std::vector<uint32_t> distinct;
  std::vector<Child> children;
  std::vector<std::pair<uint32_t, double>> chain;  // expand_chain: each source's (target, share)
};

class Grower {
 public:
  Grower(const GrowLimits& limits, Scratch& s)
      : lim_(limits), nodes_(s.nodes), kids_(s.kids), pool_(s.pool), entries_(s.entries), totals_(s.totals),
        distinct_(s.distinct), scratch_(s.children), chain_(s.chain) {
    nodes_.clear();
    kids_.clear();
    pool_.clear();
  }

  Draft run(const std::vector<Source>& roots, bool* room_hit) {
    *room_hit = false;
    uint32_t begin = uint32_t(pool_.size());
    for (const Source& s : roots) pool_.push_back(s);
    nodes_.push_back(Node{-1, 0, 1.0});
    expand(0, begin, uint32_t(pool_.size()), room_hit);
    return lim_.tree ? grow_tree(room_hit) : grow_path(room_hit);
  }

 private:
  // Computes the children of nodes_[slot] from its sources.
  void expand(uint32_t slot, uint32_t src_begin, uint32_t src_end, bool* room_hit) {
    Node& node = nodes_[slot];
    if (node.depth >= lim_.room) {
      for (uint32_t i = src_begin; i < src_end; ++i)
        if (pool_[i].automaton->has_children(pool_[i].state)) *room_hit = true;
      return;
    }
    if (expand_chain(slot, src_begin, src_end)) return;
    entries_.clear();
    totals_.assign(src_end - src_begin, 0);
    distinct_.assign(src_end - src_begin, 0);
    // The cached top children are exact for one source as long as no node can need more of
    // them than are cached; for a mixture, dropping the tail of a huge fan-out is harmless.
    const bool cache_ok = lim_.mixture || (src_end - src_begin == 1 && lim_.budget < int(Automaton::kTopK));
    for (uint32_t i = src_begin; i < src_end; ++i) {
      const Automaton& a = *pool_[i].automaton;
      const TopChildren* top = cache_ok ? a.top_children(pool_[i].state) : nullptr;
      if (top) {
        for (const Child& c : top->kids) entries_.push_back(Entry{c.token, i - src_begin, c.target, c.count});
        totals_[i - src_begin] = top->total;
        distinct_[i - src_begin] = a.degree(pool_[i].state);
        continue;
      }
      a.children(pool_[i].state, scratch_);
      for (const Child& c : scratch_) {
        entries_.push_back(Entry{c.token, i - src_begin, c.target, c.count});
        totals_[i - src_begin] += c.count;
      }
      distinct_[i - src_begin] = uint32_t(scratch_.size());
    }
    if (entries_.empty()) return;
    if (src_end - src_begin > 1)
      // a token's sources in source order, the order expand_chain sums them in
      std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) {
        return a.token != b.token ? a.token < b.token : a.source < b.source;
      });

    uint64_t total = 0;
    double weight_sum = 0.0;
    for (uint32_t i = src_begin; i < src_end; ++i) {
      total += totals_[i - src_begin];
      if (totals_[i - src_begin] > 0) weight_sum += pool_[i].weight;
    }
    const double parent_d = node.d;
    const uint32_t kid_begin = uint32_t(kids_.size());
    auto share_of = [&](const Entry& e) {
      return share(e.count, totals_[e.source], distinct_[e.source], pool_[src_begin + e.source].matched);
    };
    for (size_t a = 0; a < entries_.size();) {
      size_t b = a;
      uint64_t count = 0;
      double p = 0.0;
      for (; b < entries_.size() && entries_[b].token == entries_[a].token; ++b) {
        count += entries_[b].count;
        if (lim_.mixture) p += pool_[src_begin + entries_[b].source].weight / weight_sum * share_of(entries_[b]);
      }
      if (!lim_.mixture) p = double(count) / double(total);
      // Only kept kids get sources of their own (most continuations of a wide state fall below
      // min_prob, and that loop was most of drafting's time).
      if (parent_d * p >= lim_.min_prob) {
        const uint32_t kid_pool = uint32_t(pool_.size());
        for (size_t k = a; k < b; ++k) {
          const Entry& e = entries_[k];
          const Source& src = pool_[src_begin + e.source];
          pool_.push_back(Source{src.automaton, e.target, src.weight * share_of(e), src.matched + 1});
        }
        kids_.push_back(Kid{entries_[a].token, count, p, kid_pool, uint32_t(pool_.size())});
      }
      a = b;
    }
    std::sort(kids_.begin() + kid_begin, kids_.end(), [&](const Kid& x, const Kid& y) {
      if (lim_.mixture ? x.p != y.p : x.count != y.count) return lim_.mixture ? x.p > y.p : x.count > y.count;
      return x.token < y.token;
    });
    nodes_[slot].kid_begin = nodes_[slot].next_kid = kid_begin;
    nodes_[slot].kid_end = uint32_t(kids_.size());
  }

  // A source's share of one of its continuations. Mixture shares keep some mass for
  // continuations never seen (PPM escape): a continuation seen once out of once is not certain.
  double share(uint64_t count, uint64_t total, uint32_t distinct, int32_t matched) const {
    double escape = lim_.escape * distinct;
    if (lim_.escape_length > 0) escape /= 1.0 + matched / lim_.escape_length;
    return double(count) / (double(total) + escape);
  }

  // The common case of a long match being copied: every source has exactly one continuation,
  // the same token. The general path's arithmetic, in the same order, without its buffers,
  // sort and grouping (this case is most of the nodes of a long draft).
  bool expand_chain(uint32_t slot, uint32_t src_begin, uint32_t src_end) {
    if (src_begin == src_end) return false;
    const uint32_t token = pool_[src_begin].automaton->state(pool_[src_begin].state).token0;
    for (uint32_t i = src_begin; i < src_end; ++i) {
      const State& st = pool_[i].automaton->state(pool_[i].state);
      if (st.degree != 1 || st.token0 != token) return false;
    }
    const uint32_t n = src_end - src_begin;
    chain_.resize(n);
    uint64_t count = 0;
    double weight_sum = 0.0;
    for (uint32_t i = 0; i < n; ++i) {
      const Source& src = pool_[src_begin + i];
      const uint32_t target = src.automaton->state(src.state).target0;
      const uint32_t c = src.automaton->state(target).occ;
      chain_[i] = {target, lim_.mixture ? share(c, c, 1, src.matched) : 0.0};
      count += c;
      weight_sum += src.weight;
    }
    double p = 1.0;  // paper mode: count / total with a single continuation
    if (lim_.mixture) {
      p = 0.0;
      for (uint32_t i = 0; i < n; ++i) p += pool_[src_begin + i].weight / weight_sum * chain_[i].second;
    }
    const uint32_t kid_begin = uint32_t(kids_.size());
    if (nodes_[slot].d * p >= lim_.min_prob) {
      const uint32_t kid_pool = uint32_t(pool_.size());
      for (uint32_t i = 0; i < n; ++i) {
        const Source src = pool_[src_begin + i];  // a copy: push_back may move the pool
        const double share = lim_.mixture ? chain_[i].second : 1.0;  // paper mode never reads weights
        pool_.push_back(Source{src.automaton, chain_[i].first, src.weight * share, src.matched + 1});
      }
      kids_.push_back(Kid{token, count, p, kid_pool, uint32_t(pool_.size())});
    }
    nodes_[slot].kid_begin = nodes_[slot].next_kid = kid_begin;
    nodes_[slot].kid_end = uint32_t(kids_.size());
    return true;
  }

  bool worth_adding(double d, const Draft& draft) const {
    if (d < lim_.min_prob) return false;
    if (lim_.cost <= 0.0) return true;
    // Adding a node pays off while its acceptance probability exceeds cost x the step's
    // expected speedup (1 + score) / (1 + cost * n): the budgeted greedy rule. (A fixed
    // threshold cost x the request's achieved speedup was measured too: slightly worse on
    // every replay workload.)
    double n = double(draft.tokens.size());
    return d > lim_.cost * (1.0 + draft.score) / (1.0 + lim_.cost * n);
  }

  uint32_t add(Draft& draft, uint32_t parent_slot, const Kid& kid, double d, bool* room_hit) {
    int32_t parent_index = nodes_[parent_slot].draft_index;
    int32_t depth = nodes_[parent_slot].depth + 1;
    draft.tokens.push_back(kid.token);
    draft.parents.push_back(parent_index);
    draft.probs.push_back(d);
    draft.score += d;
    nodes_.push_back(Node{int32_t(draft.tokens.size() - 1), depth, d});
    uint32_t slot = uint32_t(nodes_.size() - 1);
    expand(slot, kid.src_begin, kid.src_end, room_hit);
    return slot;
  }

  // One allocation per array instead of one per doubling.
  Draft empty_draft() const {
    Draft draft;
    const size_t expected = size_t(std::clamp(lim_.budget, 0, 128));
    draft.tokens.reserve(expected);
    draft.parents.reserve(expected);
    draft.probs.reserve(expected);
    return draft;
  }

  Draft grow_tree(bool* room_hit) {
    Draft draft = empty_draft();
    std::priority_queue<Candidate, std::vector<Candidate>, Worse> heap;
    auto push_next_kid = [&](uint32_t slot) {
      Node& n = nodes_[slot];
      if (n.next_kid < n.kid_end) {
        const Kid& k = kids_[n.next_kid];
        heap.push(Candidate{n.d * k.p, n.draft_index, k.token, slot});
      }
    };
    push_next_kid(0);
    while (!heap.empty() && int(draft.tokens.size()) < lim_.budget) {
      Candidate c = heap.top();
      heap.pop();
      if (!worth_adding(c.d, draft)) break;
      Kid kid = kids_[nodes_[c.node].next_kid++];
      push_next_kid(c.node);  // the parent's next-best child becomes a candidate
      uint32_t slot = add(draft, c.node, kid, c.d, room_hit);
      push_next_kid(slot);
    }
    return draft;
  }

  Draft grow_path(bool* room_hit) {
    Draft draft = empty_draft();
    uint32_t slot = 0;
    while (int(draft.tokens.size()) < lim_.budget && nodes_[slot].kid_begin < nodes_[slot].kid_end) {
      Kid kid = kids_[nodes_[slot].kid_begin];
      double d = nodes_[slot].d * kid.p;
      if (!worth_adding(d, draft)) break;
      slot = add(draft, slot, kid, d, room_hit);
    }
    return draft;
  }

  const GrowLimits& lim_;
  std::vector<Node>& nodes_;
  std::vector<Kid>& kids_;
  std::vector<Source>& pool_;
  std::vector<Entry>& entries_;
  std::vector<uint64_t>& totals_;
  std::vector<uint32_t>& distinct_;
  std::vector<Child>& scratch_;
  std::vector<std::pair<uint32_t, double>>& chain_;
};

}  // namespace

Draft grow_draft(const std::vector<Source>& roots, const GrowLimits& limits, bool* room_hit) {
  thread_local Scratch scratch;
  Grower g(limits, scratch);
  return g.run(roots, room_hit);
}

}  // namespace agentaccel
