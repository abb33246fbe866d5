#include "automaton.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "errors.h"

namespace agentaccel {

namespace {

constexpr uint64_t kEmptyKey = ~uint64_t{0};

inline uint64_t edge_key(uint32_t state, uint32_t token) {
  return (uint64_t{state} << 32) | token;
}

inline uint64_t mix(uint64_t x) {  // splitmix64 finalizer: spreads (state, token) keys
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Grows by 1.125x instead of 2x so that capacity (what the memory budget counts) stays close
// to what is used.
template <class Array, class T>
inline void push(Array& v, const T& x) {
  if (v.size() == v.capacity()) v.reserve(v.capacity() + std::max<size_t>(v.capacity() / 8, 256));
  v.push_back(x);
}

constexpr size_t kAlign = 8;  // arrays start at multiples of this in a file, to be used in place

template <class T>
void put_array(IndexWriter& out, const Column<T>& v) {
  static_assert(alignof(T) <= kAlign);
  out.put(uint64_t(v.size()));
  out.pad(kAlign);
  out.append(v.data(), v.size() * sizeof(T));
}

// Padding was computed from the payload's start, which the engine keeps 8-aligned in memory:
// the absolute address gives the same answer.
template <class T>
void get_array(char*& p, const char* end, Column<T>& v, const std::shared_ptr<void>& mapping) {
  const uint64_t n = read_scalar<uint64_t>(p, end);
  size_t pad = (kAlign - reinterpret_cast<uintptr_t>(p) % kAlign) % kAlign;
  if (size_t(end - p) < pad) throw std::runtime_error("truncated array header");
  p += pad;
  if (n > uint64_t(end - p) / sizeof(T)) throw std::runtime_error("array longer than the file");
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) throw std::runtime_error("misaligned array");
  v.view(reinterpret_cast<T*>(p), n, mapping);
  p += n * sizeof(T);
}

}  // namespace

// ---------------------------------------------------------------- HubIndex

EdgeRef HubIndex::find(uint64_t key) const {
  if (keys_.empty()) return kNil;
  size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (keys_[i] == key) return vals_[i];
    if (keys_[i] == kEmptyKey) return kNil;
  }
}

void HubIndex::insert(uint64_t key, EdgeRef edge) {
  if ((size_ + 1) * 10 > keys_.size() * 7) grow();
  size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (keys_[i] == key) {
      vals_[i] = edge;
      return;
    }
    if (keys_[i] == kEmptyKey) {
      keys_[i] = key;
      vals_[i] = edge;
      ++size_;
      return;
    }
  }
}

void HubIndex::grow() {
  Column<uint64_t> old_keys = std::move(keys_);
  Column<uint32_t> old_vals = std::move(vals_);
  size_t cap = old_keys.empty() ? 1024 : old_keys.size() * 2;
  keys_.assign(cap, kEmptyKey);
  vals_.assign(cap, kNil);
  size_ = 0;
  for (size_t i = 0; i < old_keys.size(); ++i)
    if (old_keys[i] != kEmptyKey) insert(old_keys[i], old_vals[i]);
}

void HubIndex::remap_edges(const std::vector<uint32_t>& moved_to) {
  for (size_t i = 0; i < keys_.size(); ++i)
    if (keys_[i] != kEmptyKey && !(vals_[i] & kInlineEdge)) vals_[i] = moved_to[vals_[i]];
}

void HubIndex::clear() {
  keys_.clear();
  keys_.shrink_to_fit();
  vals_.clear();
  vals_.shrink_to_fit();
  size_ = 0;
}

void HubIndex::write(IndexWriter& out) const {
  out.put(uint64_t(size_));
  put_array(out, keys_);
  put_array(out, vals_);
}

void HubIndex::read(char*& p, const char* end, const std::shared_ptr<void>& mapping, size_t states, size_t edges) {
  const uint64_t n = read_scalar<uint64_t>(p, end);
  get_array(p, end, keys_, mapping);
  get_array(p, end, vals_, mapping);
  size_ = n;
  const size_t cap = keys_.size();
  if (vals_.size() != cap || (cap & (cap - 1)) != 0) throw std::runtime_error("malformed hub index");
  size_t used = 0;
  for (size_t i = 0; i < cap; ++i) {
    EdgeRef e = vals_[i];
    if (keys_[i] == kEmptyKey) continue;
    ++used;
    if (e & kInlineEdge ? (e & ~kInlineEdge) >= states : e >= edges) throw std::runtime_error("hub entry out of range");
  }
  // Probing stops at an empty slot: the load limit guarantees there is one.
  if (used != n || n * 10 > cap * 7) throw std::runtime_error("malformed hub index");
}

// ---------------------------------------------------------------- PackedTokens

uint64_t PackedTokens::append(const uint32_t* tokens, size_t n) {
  uint64_t offset = bytes_.size();
  for (size_t i = 0; i < n; ++i) {
    uint32_t t = tokens[i];
    while (t >= 0x80) {
      push(bytes_, uint8_t(t | 0x80));
      t >>= 7;
    }
    push(bytes_, uint8_t(t));
  }
  return offset;
}

bool PackedTokens::decode(uint64_t offset, uint64_t n, std::vector<uint32_t>& out, uint64_t* end_offset) const {
  out.clear();
  if (offset > bytes_.size()) return false;
  out.reserve(n);
  const uint8_t* p = bytes_.data() + offset;
  const uint8_t* end = bytes_.data() + bytes_.size();
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t t = 0;
    for (int shift = 0;; shift += 7) {
      if (p == end || shift > 28) return false;
      uint8_t b = *p++;
      t |= uint32_t(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    out.push_back(t);
  }
  if (end_offset) *end_offset = uint64_t(p - bytes_.data());
  return true;
}

// ---------------------------------------------------------------- Automaton

Automaton::Automaton(bool global_tree) : global_(global_tree) {
  if (global_tree) top_cache_ = std::make_unique<TopCache>();
  new_state(0, -1, 0);
}

void check_document_length(uint64_t have, size_t n) {
  if (have > kMaxDocumentTokens || n > kMaxDocumentTokens - have)
    throw InvalidInput("a document or request context is limited to " + std::to_string(kMaxDocumentTokens) +
                       " tokens");
}

const TopChildren* Automaton::top_children(uint32_t state) const {
  if (!top_cache_ || states_[state].degree <= kCachedDegree) return nullptr;
  std::lock_guard lock(top_cache_->mu);
  auto& slot = top_cache_->by_state[state];
  if (!slot) {
    auto top = std::make_unique<TopChildren>();
    children(state, top->kids);
    top->total = 0;
    for (const Child& c : top->kids) top->total += c.count;
    auto better = [](const Child& a, const Child& b) { return a.count != b.count ? a.count > b.count : a.token < b.token; };
    size_t k = std::min<size_t>(kTopK, top->kids.size());
    std::partial_sort(top->kids.begin(), top->kids.begin() + k, top->kids.end(), better);
    top->kids.resize(k);
    top->kids.shrink_to_fit();
    slot = std::move(top);
  }
  return slot.get();
}

namespace {
// Recency weights grow as 2^(t / half_life); long before a double overflows, every weight and the
// next term are scaled down alike (only their ratios are read). Shared by the update and the check.
void keep_recency_in_range(double& gain, std::vector<double>& weights) {
  if (gain <= 0x1p600) return;
  for (double& w : weights) w *= 0x1p-600;
  gain *= 0x1p-600;
}
}  // namespace

uint32_t Automaton::new_state(int32_t len, int32_t link, uint32_t occ) {
  push(states_, State{uint32_t(len), 0, link, occ, 0, kNil, kNil});
  if (!recent_.empty()) recent_.push_back(0.0);
  return uint32_t(states_.size() - 1);
}

void Automaton::set_recency(double half_life) {
  if (global_ || num_tokens_ > 0) throw InvalidInput("recency is set on an empty request tree");
  if (!(half_life >= 0.0)) throw InvalidInput("recency half-life must be >= 0");
  recent_.clear();
  if (half_life == 0.0) return;
  recent_.assign(states_.size(), 0.0);
  recent_gain_ = 1.0;
  recent_step_ = std::exp2(1.0 / half_life);
}

EdgeRef Automaton::find_edge(uint32_t from, uint32_t token) const {
  const State& s = states_[from];
  if (s.degree > kHubDegree) return hub_.find(edge_key(from, token));
  if (s.target0 == kNil) return kNil;
  if (s.token0 == token) return kInlineEdge | from;
  for (uint32_t e = s.more; e != kNil; e = edges_[e].next)
    if (edges_[e].token == token) return e;
  return kNil;
}

uint32_t Automaton::next(uint32_t state, uint32_t token) const {
  EdgeRef e = find_edge(state, token);
  if (e == kNil) return kNil;
  return e & kInlineEdge ? states_[e & ~kInlineEdge].target0 : edges_[e].target;
}

void Automaton::add_edge(uint32_t from, uint32_t token, uint32_t to) {
  EdgeRef ref;
  if (states_[from].target0 == kNil) {
    states_[from].token0 = token;
    states_[from].target0 = to;
    ref = kInlineEdge | from;
  } else {
    push(edges_, Edge{token, to, states_[from].more});
    ref = uint32_t(edges_.size() - 1);
    states_[from].more = ref;
  }
  State& src = states_[from];
  if (src.degree < 255) ++src.degree;
  const uint32_t deg = src.degree;
  if (deg == kHubDegree + 1)
    index_hub(from);
  else if (deg > kHubDegree + 1)
    hub_.insert(edge_key(from, token), ref);
}

void Automaton::index_hub(uint32_t state) {
  const State& s = states_[state];
  if (s.target0 == kNil) return;
  hub_.insert(edge_key(state, s.token0), kInlineEdge | state);
  for (uint32_t e = s.more; e != kNil; e = edges_[e].next) hub_.insert(edge_key(state, edges_[e].token), e);
}

void Automaton::copy_edges(uint32_t from, uint32_t to) {
  if (states_[from].target0 == kNil) return;
  add_edge(to, states_[from].token0, states_[from].target0);
  for (uint32_t e = states_[from].more; e != kNil; e = edges_[e].next) {
    Edge copy = edges_[e];  // copy first: add_edge may reallocate edges_
    add_edge(to, copy.token, copy.target);
  }
}

void Automaton::extend(uint32_t c) {
  uint32_t p = last_;
  uint32_t cur;
  uint32_t q = next(p, c);
  if (q != kNil) {
    // Generalized automaton: this string already exists (another document had it).
    if (states_[q].len == states_[p].len + 1) {
      cur = q;
    } else {
      uint32_t clone = new_state(states_[p].len + 1, states_[q].link, states_[q].occ);
      if (!recent_.empty()) recent_[clone] = recent_[q];
      copy_edges(q, clone);
      for (int32_t v = int32_t(p); v != -1; v = states_[v].link) {
        EdgeRef e = find_edge(uint32_t(v), c);
        if (e == kNil || target_of(e) != q) break;
        target_of(e) = clone;
      }
      states_[q].link = int32_t(clone);
      cur = clone;
    }
  } else {
    cur = new_state(states_[p].len + 1, 0, 0);
    int32_t v = int32_t(p);
    while (v != -1 && next(uint32_t(v), c) == kNil) {
      add_edge(uint32_t(v), c, cur);
      v = states_[v].link;
    }
    if (v != -1) {
      q = next(uint32_t(v), c);
      if (states_[v].len + 1 == states_[q].len) {
        states_[cur].link = int32_t(q);
      } else {
        uint32_t clone = new_state(states_[v].len + 1, states_[q].link, states_[q].occ);
        if (!recent_.empty()) recent_[clone] = recent_[q];
        copy_edges(q, clone);
        for (; v != -1; v = states_[v].link) {
          EdgeRef e = find_edge(uint32_t(v), c);
          if (e == kNil || target_of(e) != q) break;
          target_of(e) = clone;
        }
        states_[q].link = int32_t(clone);
        states_[cur].link = int32_t(clone);
      }
    }
  }
  last_ = cur;
  // The new end position belongs to every class on the suffix-link path of the new prefix.
  if (recent_.empty()) {
    for (int32_t v = int32_t(cur); v != -1; v = states_[v].link) ++states_[v].occ;
  } else {
    for (int32_t v = int32_t(cur); v != -1; v = states_[v].link) {
      ++states_[v].occ;
      recent_[v] += recent_gain_;
    }
    recent_gain_ *= recent_step_;
    keep_recency_in_range(recent_gain_, recent_);
  }
}

void Automaton::add_document(uint64_t id, const uint32_t* tokens, size_t n) {
  last_ = 0;
  check_document_length(states_[last_].len, n);
  if (top_cache_) top_cache_->by_state.clear();
  push(docs_, DocRecord{id, packed_.append(tokens, n), n});
  num_tokens_ += n;
  for (size_t i = 0; i < n; ++i) extend(tokens[i]);
}

void Automaton::append(const uint32_t* tokens, size_t n) {
  check_document_length(states_[last_].len, n);
  if (top_cache_) top_cache_->by_state.clear();
  for (size_t i = 0; i < n; ++i) {
    push(tokens_, tokens[i]);
    extend(tokens[i]);
  }
  num_tokens_ += n;
}

std::vector<uint32_t> Automaton::document_tokens(const DocRecord& doc) const {
  std::vector<uint32_t> out;
  if (!packed_.decode(doc.offset, doc.length, out))
    throw std::runtime_error("document " + std::to_string(doc.id) + " runs past the token arena");
  return out;
}

void Automaton::children(uint32_t state, std::vector<Child>& out) const {
  out.clear();
  const State& s = states_[state];
  if (s.target0 == kNil) return;
  // Targets first, counts second: the counts are scattered over the states, and asking for all
  // of them before reading any overlaps their cache misses instead of paying them in turn.
  out.push_back(Child{s.token0, s.target0, 0});
  for (uint32_t e = s.more; e != kNil; e = edges_[e].next) {
    out.push_back(Child{edges_[e].token, edges_[e].target, 0});
    __builtin_prefetch(&states_[edges_[e].target]);
  }
  for (Child& c : out) c.count = states_[c.target].occ;
}

void Automaton::step(uint32_t& state, int32_t& matched, uint32_t token) const {
  for (;;) {
    uint32_t t = next(state, token);
    if (t != kNil) {
      state = t;
      ++matched;
      return;
    }
    if (state == 0) {
      matched = 0;
      return;
    }
    state = uint32_t(states_[state].link);
    matched = states_[state].len;
  }
}

uint32_t Automaton::ancestor_for_length(uint32_t state, int32_t len) const {
  while (states_[state].link != -1 && states_[states_[state].link].len >= len)
    state = uint32_t(states_[state].link);
  return state;
}

size_t Automaton::bytes() const {
  return sizeof(*this) + states_.capacity() * sizeof(State) + edges_.capacity() * sizeof(Edge) +
         tokens_.capacity() * sizeof(uint32_t) + packed_.bytes() + docs_.capacity() * sizeof(DocRecord) +
         hub_.bytes() + recent_.capacity() * sizeof(double);
}

void Automaton::compact() {
  states_.shrink_to_fit();
  cluster_edges();
  tokens_.shrink_to_fit();
  packed_.compact();
  docs_.shrink_to_fit();
#if defined(__GLIBC__)
  // The old arrays were freed into the heap, which glibc keeps mapped: without this the process
  // holds ~25 % more than the index needs (RSS measured in `bench engine`).
  malloc_trim(0);
#endif
}

// Edges are appended as continuations appear, so a state's list is scattered over the arena
// and walking it (drafting reads every child of a state) is one dependent cache miss per edge.
// Rewritten so that each list is one contiguous run, still ordered head to tail by descending
// index (the invariant load checks), with the runs in state order.
void Automaton::cluster_edges() {
  const size_t m = edges_.size();
  if (m == 0) {
    edges_.shrink_to_fit();
    return;
  }
  std::vector<uint32_t> moved_to(m);
  Column<Edge> out;
  out.resize(m);
  uint32_t pos = 0;
  for (size_t s = 0; s < states_.size(); ++s) {
    State& st = states_[s];
    uint32_t k = 0;
    for (uint32_t e = st.more; e != kNil; e = edges_[e].next) ++k;
    if (k == 0) continue;
    uint32_t at = pos + k - 1;  // the head takes the highest index of the run
    for (uint32_t e = st.more; e != kNil; e = edges_[e].next, --at) {
      moved_to[e] = at;
      out[at] = Edge{edges_[e].token, edges_[e].target, at == pos ? kNil : at - 1};
    }
    st.more = pos + k - 1;
    pos += k;
  }
  edges_ = std::move(out);
  hub_.remap_edges(moved_to);
  if (top_cache_) top_cache_->by_state.clear();
}

std::string Automaton::check() const {
  // Ranges first (what loading checks), then what needs random access: suffix links shorten,
  // edges lengthen, no edge is shared, degrees and the hub agree, documents tile the arena.
  if (std::string problem = check_bounds(); !problem.empty()) return problem;
  const size_t n = states_.size(), m = edges_.size();
  std::vector<uint8_t> seen(m, 0);
  size_t listed = 0;
  for (size_t s = 0; s < n; ++s) {
    const State& st = states_[s];
    const std::string at = " at state " + std::to_string(s);
    if (s > 0 && states_[st.link].len >= st.len) return "suffix link does not shorten" + at;
    uint32_t count = 0;
    if (st.target0 != kNil) {
      if (states_[st.target0].len < st.len + 1) return "edge does not lengthen" + at;
      count = 1;
    }
    for (uint32_t e = st.more; e != kNil; e = edges_[e].next) {
      if (seen[e]++) return "edge shared or cyclic" + at;
      if (states_[edges_[e].target].len < st.len + 1) return "edge does not lengthen" + at;
      ++count;
      ++listed;
    }
    if (std::min<uint32_t>(count, 255) != st.degree) return "degree mismatch" + at;
    if (st.degree > kHubDegree) {  // every edge of a hub state must be found through the hub
      if (hub_.find(edge_key(uint32_t(s), st.token0)) != (kInlineEdge | uint32_t(s))) return "hub misses an edge" + at;
      for (uint32_t e = st.more; e != kNil; e = edges_[e].next)
        if (hub_.find(edge_key(uint32_t(s), edges_[e].token)) != e) return "hub misses an edge" + at;
    }
  }
  if (listed != m) return "orphan edges";
  if (global_) {
    // Documents tile the packed arena in order: each is decoded where the previous one ended.
    std::vector<uint32_t> buf;
    uint64_t offset = 0;
    for (const DocRecord& d : docs_)
      if (d.offset != offset || !packed_.decode(d.offset, d.length, buf, &offset)) return "document out of token range";
    if (offset != packed_.size_bytes()) return "stray bytes after the last document";
  }
  return {};
}

std::string Automaton::check_counts() const {
  std::vector<uint64_t> count(states_.size(), 0);
  auto walk = [&](const std::vector<uint32_t>& tokens) -> bool {
    uint32_t s = 0;
    for (uint32_t t : tokens) {
      s = next(s, t);
      if (s == kNil) return false;
      ++count[s];
    }
    return true;
  };
  if (!global_) {
    if (!walk(tokens_)) return "request tokens missing from the index";
  } else {
    for (const DocRecord& d : docs_)
      if (!walk(document_tokens(d))) return "document " + std::to_string(d.id) + " missing from the index";
  }
  std::vector<uint32_t> order(states_.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return states_[a].len > states_[b].len; });
  for (uint32_t s : order)
    if (states_[s].link >= 0) count[states_[s].link] += count[s];
  for (uint32_t s = 0; s < states_.size(); ++s)
    if (count[s] != states_[s].occ)
      return "count mismatch at state " + std::to_string(s) + ": stored " + std::to_string(states_[s].occ) +
             ", recounted " + std::to_string(count[s]);
  if (recent_.empty() || tokens_.empty()) return {};  // no tokens: no weights to compare (0 / 0)
  // Recency weights: position i adds step^i to the class of prefix i and to its suffix-link
  // ancestors; compared as ratios to the root's (on every path), as they are read.
  std::vector<double> weight(states_.size(), 0.0);
  double gain = 1.0;
  uint32_t s = 0;
  for (uint32_t t : tokens_) {
    s = next(s, t);
    weight[s] += gain;
    gain *= recent_step_;
    keep_recency_in_range(gain, weight);
  }
  for (uint32_t v : order)
    if (states_[v].link >= 0) weight[states_[v].link] += weight[v];
  for (uint32_t v = 0; v < states_.size(); ++v) {
    const double want = weight[v] / weight[0], got = recent_[v] / recent_[0];
    if (!(std::abs(want - got) <= 1e-9 * std::max(1.0, want)))  // NaN (an overflow) fails too
      return "recency weight mismatch at state " + std::to_string(v);
  }
  return {};
}

void Automaton::write(IndexWriter& out) const {
  put_array(out, states_);
  put_array(out, edges_);
  put_array(out, packed_.raw());
  put_array(out, docs_);
  out.put(uint64_t(num_tokens_));
  out.put(uint32_t(last_));
  hub_.write(out);  // saved rather than rebuilt: a rebuild scans every state at load
}

void Automaton::read(char*& p, const char* end, const std::shared_ptr<void>& mapping) {
  get_array(p, end, states_, mapping);
  get_array(p, end, edges_, mapping);
  get_array(p, end, packed_.raw(), mapping);
  get_array(p, end, docs_, mapping);
  num_tokens_ = read_scalar<uint64_t>(p, end);
  last_ = read_scalar<uint32_t>(p, end);
  hub_.read(p, end, mapping, states_.size(), edges_.size());
  std::string problem = check_bounds();
  if (!problem.empty()) throw std::runtime_error("inconsistent automaton: " + problem);
  if (top_cache_) top_cache_->by_state.clear();
}

std::string Automaton::check_bounds() const {
  const size_t n = states_.size(), m = edges_.size();
  if (n == 0 || n >= kNil || m >= kInlineEdge) return "bad array sizes";
  if (states_[0].link != -1 || states_[0].len != 0) return "bad root state";
  if (last_ >= n) return "append point out of range";
  for (size_t s = 0; s < n; ++s) {
    const State& st = states_[s];
    const auto at = [s] { return " at state " + std::to_string(s); };
    // Also a link to itself would make suffix-link walks endless (longer cycles need check()).
    if (s > 0 && (st.link < 0 || size_t(st.link) >= n || size_t(st.link) == s)) return "suffix link out of range" + at();
    if (st.target0 != kNil && st.target0 >= n) return "edge target out of range" + at();
    if (st.more != kNil && (st.more >= m || st.target0 == kNil)) return "edge list out of range" + at();
  }
  // Each new edge heads its state's list, so a list always runs to older (smaller) indices: no cycle.
  for (size_t e = 0; e < m; ++e)
    if (edges_[e].target >= n || (edges_[e].next != kNil && edges_[e].next >= e)) return "edge out of range";
  // No edge in two lists (compaction lays each list out once: a shared edge would write past the
  // arena); each edge is visited at most once before a repeat shows, so this is O(states + edges).
  std::vector<bool> listed_edge(m, false);
  for (size_t s = 0; s < n; ++s)
    for (uint32_t e = states_[s].more; e != kNil; e = edges_[e].next) {
      if (listed_edge[e]) return "edge " + std::to_string(e) + " in two lists";
      listed_edge[e] = true;
    }
  uint64_t listed = 0;
  for (const DocRecord& d : docs_) {
    if (d.offset > packed_.size_bytes() || d.length > packed_.size_bytes() - d.offset) return "document out of token range";
    listed += d.length;
  }
  if (global_ ? listed != num_tokens_ : (!docs_.empty() || num_tokens_ != tokens_.size())) return "token counts do not add up";
  return {};
}

}  // namespace agentaccel
