#include "drafter.h"

#include <algorithm>
#include <vector>

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
  double weight;    // mixture: the count it weighs (count, or partly recency-weighted)
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
  std::vector<double> per_count;  // expand: each source's share of one occurrence
  std::vector<double> mixed;      // expand: each source's part of p per occurrence
  std::vector<Source> run;        // add_run: the sources of the node a copy has reached
  std::vector<Candidate> heap;    // grow_tree: candidates, best first under Worse
};

class Grower {
 public:
  Grower(const GrowLimits& limits, Scratch& s) : lim_(limits), s_(s) {
    s_.nodes.clear();
    s_.kids.clear();
    s_.pool.clear();
  }

  void run(const std::vector<Source>& roots, bool* room_hit, Draft& draft) {
    *room_hit = false;
    uint32_t begin = uint32_t(s_.pool.size());
    for (const Source& s : roots) s_.pool.push_back(s);
    s_.nodes.push_back(Node{-1, 0, 1.0});
    expand(0, begin, uint32_t(s_.pool.size()), room_hit);
    reset(draft);
    if (lim_.tree)
      grow_tree(draft, room_hit);
    else
      grow_path(draft, room_hit);
  }

 private:
  // Computes the children of s_.nodes[slot] from its sources.
  void expand(uint32_t slot, uint32_t src_begin, uint32_t src_end, bool* room_hit) {
    Node& node = s_.nodes[slot];
    if (node.depth >= lim_.room) {
      for (uint32_t i = src_begin; i < src_end; ++i)
        if (s_.pool[i].automaton->has_children(s_.pool[i].state)) *room_hit = true;
      return;
    }
    if (expand_chain(slot, src_begin, src_end)) return;
    const uint32_t num_sources = src_end - src_begin;
    s_.entries.clear();
    s_.totals.assign(num_sources, 0);
    s_.distinct.assign(num_sources, 0);
    // The cached top children are exact for one source as long as no node can need more of
    // them than are cached; for a mixture, dropping the tail of a huge fan-out is harmless.
    const bool cache_ok = lim_.mixture || (num_sources == 1 && lim_.budget < int(Automaton::kTopK));
    for (uint32_t k = 0; k < num_sources; ++k) {
      const Automaton& a = *s_.pool[src_begin + k].automaton;
      const uint32_t state = s_.pool[src_begin + k].state;
      if (const TopChildren* top = cache_ok ? a.top_children(state) : nullptr) {
        for (const Child& c : top->kids) s_.entries.push_back(Entry{c.token, k, c.target, c.count, double(c.count)});
        s_.totals[k] = top->total;
        s_.distinct[k] = a.degree(state);
        continue;
      }
      a.children(state, s_.children);
      for (const Child& c : s_.children) s_.totals[k] += c.count;
      s_.distinct[k] = uint32_t(s_.children.size());
      // Recency: the same total, shared out partly by how recently each continuation occurred
      // (in a long trajectory the latest way a pattern went on is the likeliest next one).
      double recent_sum = 0.0;
      if (lim_.mixture && lim_.recency > 0.0 && a.has_recency())
        for (const Child& c : s_.children) recent_sum += a.recent_weight(c.target);
      const double r = recent_sum > 0.0 ? lim_.recency : 0.0;
      const double per_recent = recent_sum > 0.0 ? double(s_.totals[k]) / recent_sum : 0.0;
      for (const Child& c : s_.children) {
        const double weight = r > 0.0 ? (1.0 - r) * c.count + r * a.recent_weight(c.target) * per_recent : double(c.count);
        s_.entries.push_back(Entry{c.token, k, c.target, c.count, weight});
      }
    }
    if (s_.entries.empty()) return;
    if (num_sources > 1)
      // a token's sources in source order, the order expand_chain sums them in
      std::sort(s_.entries.begin(), s_.entries.end(), [](const Entry& a, const Entry& b) {
        return a.token != b.token ? a.token < b.token : a.source < b.source;
      });

    uint64_t total = 0;
    double weight_sum = 0.0;
    for (uint32_t k = 0; k < num_sources; ++k) {
      total += s_.totals[k];
      if (s_.totals[k] > 0) weight_sum += s_.pool[src_begin + k].weight;
    }
    // Mixture: a source's share of a continuation is count x per_count (the divisions are done
    // once per source, not per continuation), and its part of the kid's p is count x mixed.
    s_.per_count.resize(num_sources);
    s_.mixed.resize(num_sources);
    if (lim_.mixture)
      for (uint32_t k = 0; k < num_sources; ++k) {
        s_.per_count[k] = share_scale(s_.totals[k], s_.distinct[k], s_.pool[src_begin + k].matched);
        s_.mixed[k] = s_.pool[src_begin + k].weight / weight_sum * s_.per_count[k];
      }
    const double parent_d = node.d;
    const uint32_t kid_begin = uint32_t(s_.kids.size());
    for (size_t a = 0; a < s_.entries.size();) {
      size_t b = a;
      uint64_t count = 0;
      double p = 0.0;
      for (; b < s_.entries.size() && s_.entries[b].token == s_.entries[a].token; ++b) {
        count += s_.entries[b].count;
        if (lim_.mixture) p += s_.entries[b].weight * s_.mixed[s_.entries[b].source];
      }
      if (!lim_.mixture) p = double(count) / double(total);
      // Only kept kids get sources of their own (most continuations of a wide state fall below
      // min_prob, and that loop was most of drafting's time).
      if (parent_d * p >= lim_.min_prob) {
        const uint32_t kid_pool = uint32_t(s_.pool.size());
        for (size_t k = a; k < b; ++k) {
          const Entry& e = s_.entries[k];
          const Source& src = s_.pool[src_begin + e.source];
          s_.pool.push_back(Source{src.automaton, e.target, src.weight * (e.weight * s_.per_count[e.source]), src.matched + 1});
        }
        s_.kids.push_back(Kid{s_.entries[a].token, count, p, kid_pool, uint32_t(s_.pool.size())});
      }
      a = b;
    }
    std::sort(s_.kids.begin() + kid_begin, s_.kids.end(), [&](const Kid& x, const Kid& y) {
      if (lim_.mixture ? x.p != y.p : x.count != y.count) return lim_.mixture ? x.p > y.p : x.count > y.count;
      return x.token < y.token;
    });
    s_.nodes[slot].kid_begin = s_.nodes[slot].next_kid = kid_begin;
    s_.nodes[slot].kid_end = uint32_t(s_.kids.size());
  }

  // A source's share of one of its continuations is count x this. Mixture shares keep some
  // mass for continuations never seen (PPM escape): a continuation seen once out of once is not
  // certain.
  double share_scale(uint64_t total, uint32_t distinct, int32_t matched) const {
    double escape = lim_.escape * distinct;
    if (lim_.escape_length > 0) escape /= 1.0 + matched / lim_.escape_length;
    return 1.0 / (double(total) + escape);
  }

  // The common case of a long match being copied: every source has exactly one continuation,
  // the same token. If so, fills s_.chain with each source's (target, share) and gives the
  // continuation's token, summed count and p: the general path's arithmetic, in the same order,
  // without its buffers, sort and grouping (this case is most of the nodes of a long draft).
  bool chain_step(const Source* src, uint32_t n, uint32_t& token, uint64_t& count, double& p) {
    if (n == 0) return false;
    token = src[0].automaton->state(src[0].state).token0;
    for (uint32_t i = 0; i < n; ++i) {
      const State& st = src[i].automaton->state(src[i].state);
      if (st.degree != 1 || st.token0 != token) return false;
    }
    s_.chain.resize(n);
    count = 0;
    double weight_sum = 0.0;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t target = src[i].automaton->state(src[i].state).target0;
      src[i].automaton->prefetch_after(target);
      const uint32_t c = src[i].automaton->state(target).occ;
      s_.chain[i] = {target, lim_.mixture ? c * share_scale(c, 1, src[i].matched) : 0.0};
      count += c;
      weight_sum += src[i].weight;
    }
    p = 1.0;  // paper mode: count / total with a single continuation
    if (lim_.mixture) {
      p = 0.0;
      for (uint32_t i = 0; i < n; ++i) p += src[i].weight / weight_sum * s_.chain[i].second;
    }
    return true;
  }

  // Source i of the last chain_step, one token further.
  Source advanced(const Source& src, uint32_t i) const {
    const double share = lim_.mixture ? s_.chain[i].second : 1.0;  // paper mode never reads weights
    return Source{src.automaton, s_.chain[i].first, src.weight * share, src.matched + 1};
  }

  bool expand_chain(uint32_t slot, uint32_t src_begin, uint32_t src_end) {
    uint32_t token;
    uint64_t count;
    double p;
    if (!chain_step(s_.pool.data() + src_begin, src_end - src_begin, token, count, p)) return false;
    add_chain_kid(slot, src_begin, src_end, token, count, p);
    return true;
  }

  // The single kid of a copy node whose chain_step gave (token, count, p), if it can pass min_prob.
  void add_chain_kid(uint32_t slot, uint32_t src_begin, uint32_t src_end, uint32_t token, uint64_t count, double p) {
    const uint32_t kid_begin = uint32_t(s_.kids.size());
    if (s_.nodes[slot].d * p >= lim_.min_prob) {
      const uint32_t kid_pool = uint32_t(s_.pool.size());
      for (uint32_t i = 0; i < src_end - src_begin; ++i) {
        const Source src = s_.pool[src_begin + i];  // a copy: push_back may move the pool
        s_.pool.push_back(advanced(src, i));
      }
      s_.kids.push_back(Kid{token, count, p, kid_pool, uint32_t(s_.pool.size())});
    }
    s_.nodes[slot].kid_begin = s_.nodes[slot].next_kid = kid_begin;
    s_.nodes[slot].kid_end = uint32_t(s_.kids.size());
  }

  bool worth_adding(double d, const Draft& draft) const {
    if (d < lim_.min_prob) return false;
    if (lim_.cost <= 0.0) return true;
    if (lim_.fixed_threshold) return lim_.confidence * d > lim_.cost;
    // Adding a node pays off while its acceptance probability exceeds cost x the step's
    // expected speedup (1 + score) / (1 + cost * n): the budgeted greedy rule. (A fixed
    // threshold cost x the request's achieved speedup was measured too: slightly worse on
    // every replay workload.)
    // The probabilities are trusted as far as the stage's confidence says.
    double n = double(draft.tokens.size());
    return lim_.confidence * d > lim_.cost * (1.0 + lim_.confidence * draft.score) / (1.0 + lim_.cost * n);
  }

  // Empties the draft, keeping its buffers (one allocation per array instead of one per doubling).
  void reset(Draft& draft) const {
    draft.tokens.clear();
    draft.parents.clear();
    draft.probs.clear();
    draft.score = 0.0;
    draft.match_len = 0;
    draft.source.clear();
    const size_t expected = size_t(std::clamp(lim_.budget, 0, 128));
    draft.tokens.reserve(expected);
    draft.parents.reserve(expected);
    draft.probs.reserve(expected);
  }

  static void append(Draft& draft, uint32_t token, int32_t parent_index, double d) {
    draft.tokens.push_back(token);
    draft.parents.push_back(parent_index);
    draft.probs.push_back(d);
    draft.score += d;
  }

  void grow_tree(Draft& draft, bool* room_hit) {
    std::vector<Candidate>& heap = s_.heap;  // a max-heap under Worse
    heap.clear();
    auto push_next_kid = [&](uint32_t slot) {
      if (slot == kNoSlot) return;
      Node& n = s_.nodes[slot];
      if (n.next_kid < n.kid_end) {
        const Kid& k = s_.kids[n.next_kid];
        heap.push_back(Candidate{n.d * k.p, n.draft_index, k.token, slot});
        std::push_heap(heap.begin(), heap.end(), Worse{});
      }
    };
    // A run may go on while its next node would be the next candidate popped anyway: strictly
    // better than the best waiting one (on a tie the waiting one wins: it has the older parent).
    auto next_in_line = [&](double d) { return heap.empty() || d > heap.front().d; };
    push_next_kid(0);
    while (!heap.empty() && int(draft.tokens.size()) < lim_.budget) {
      std::pop_heap(heap.begin(), heap.end(), Worse{});
      const Candidate c = heap.back();
      heap.pop_back();
      if (!worth_adding(c.d, draft)) break;
      const Kid kid = s_.kids[s_.nodes[c.node].next_kid++];
      push_next_kid(c.node);  // the parent's next-best child becomes a candidate
      push_next_kid(add_run(draft, c.node, kid, c.d, room_hit, next_in_line));
    }
  }

  void grow_path(Draft& draft, bool* room_hit) {
    auto always = [](double) { return true; };
    uint32_t slot = 0;
    while (slot != kNoSlot && int(draft.tokens.size()) < lim_.budget && s_.nodes[slot].kid_begin < s_.nodes[slot].kid_end) {
      Kid kid = s_.kids[s_.nodes[slot].kid_begin];
      double d = s_.nodes[slot].d * kid.p;
      if (!worth_adding(d, draft)) break;
      slot = add_run(draft, slot, kid, d, room_hit, always);
    }
  }

  // Adds `kid` under parent_slot, then goes on copying while every source continues with one
  // same token and `may_continue` says its next node would be drafted next anyway, keeping the
  // sources in s_.run instead of a node, kids and pool entries per token (the decisions of the
  // node-by-node growth, in the same order; most nodes of a long draft are such copies).
  // Returns the slot of the node where the run stopped, with its kids computed, or kNoSlot when
  // that node can have none that would be drafted.
  template <class MayContinue>
  uint32_t add_run(Draft& draft, uint32_t parent_slot, const Kid& kid, double d, bool* room_hit,
                   MayContinue&& may_continue) {
    int32_t depth = s_.nodes[parent_slot].depth;
    int32_t parent_index = s_.nodes[parent_slot].draft_index;
    s_.run.assign(s_.pool.begin() + kid.src_begin, s_.pool.begin() + kid.src_end);
    uint32_t token = kid.token;
    // The node the run stopped at, with the run's sources in the pool.
    auto node_here = [&] {
      const uint32_t begin = uint32_t(s_.pool.size());
      s_.pool.insert(s_.pool.end(), s_.run.begin(), s_.run.end());
      s_.nodes.push_back(Node{parent_index, depth, d});
      return std::pair{uint32_t(s_.nodes.size() - 1), begin};
    };
    for (;;) {
      append(draft, token, parent_index, d);
      parent_index = int32_t(draft.tokens.size() - 1);
      if (++depth >= lim_.room) {
        for (const Source& src : s_.run)
          if (src.automaton->has_children(src.state)) *room_hit = true;
        return kNoSlot;
      }
      uint32_t next;
      uint64_t count;
      double p;
      if (!chain_step(s_.run.data(), uint32_t(s_.run.size()), next, count, p)) {
        const auto [slot, begin] = node_here();
        expand(slot, begin, uint32_t(s_.pool.size()), room_hit);  // a branching node: the general path
        return slot;
      }
      const double next_d = d * p;
      // The draft's threshold only rises as nodes are added, so a node that fails it now never passes.
      if (next_d < lim_.min_prob || int(draft.tokens.size()) >= lim_.budget || !worth_adding(next_d, draft))
        return kNoSlot;
      if (!may_continue(next_d)) {  // its one kid waits among the candidates, as computed above
        const auto [slot, begin] = node_here();
        add_chain_kid(slot, begin, uint32_t(s_.pool.size()), next, count, p);
        return slot;
      }
      for (uint32_t i = 0; i < s_.run.size(); ++i) s_.run[i] = advanced(s_.run[i], i);
      d = next_d;
      token = next;
    }
  }

  static constexpr uint32_t kNoSlot = 0xFFFFFFFFu;

  const GrowLimits& lim_;
  Scratch& s_;  // every buffer, reused across calls on this thread
};

}  // namespace

void grow_draft(const std::vector<Source>& roots, const GrowLimits& limits, bool* room_hit, Draft& out) {
  thread_local Scratch scratch;
  Grower g(limits, scratch);
  g.run(roots, room_hit, out);
}

}  // namespace agentaccel
