// Generalized suffix automaton over a set of token documents: the index behind every
// "suffix tree" of agentaccel.
//
// Why an automaton instead of a path-compressed suffix tree: it is built online in amortized
// O(1) per token (no per-token walk over D active suffixes), it has at most 2n states and 3n
// transitions in flat arrays (cheap to save, load and check), and for every string x the
// state reached by x carries |endpos(x)| = the number of occurrences of x, which is exactly the
// COUNT of the suffix-tree node for x at any depth. Transitions of the state reached by a
// pattern are the suffix-tree node's children. Removing a document is a rebuild (see engine).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "column.h"
#include "index_file.h"

namespace agentaccel {

constexpr uint32_t kNil = 0xFFFFFFFFu;

// Longest document (or request context) a tree takes: State::len has 24 bits.
constexpr uint32_t kMaxDocumentTokens = (1u << 24) - 1;
// Throws InvalidInput when a document of `have` tokens cannot take `n` more.
void check_document_length(uint64_t have, size_t n);

// Most states have exactly one outgoing edge, so the first edge lives inside the state: one
// cache line per drafted node, and no edge record at all for most states.
struct State {
  uint32_t len : 24;    // length of the longest string in this end-position class
  uint32_t degree : 8;  // outgoing edges, saturating at 255 (hub and cache thresholds only)
  int32_t link;     // suffix link: class of the longest proper suffix outside this class (-1 at root)
  uint32_t occ;     // |endpos|: occurrences of every string of the class (the paper's COUNT)
  uint32_t token0;  // token of the first outgoing edge
  uint32_t target0; // target of the first outgoing edge (kNil: no edges at all)
  uint32_t more;    // head of the list of further edges in the edge arena (kNil when none)
};
static_assert(sizeof(State) == 24, "State must stay 24 bytes: it is most of the index");

struct Edge {
  uint32_t token;   // token id labelling the transition
  uint32_t target;  // destination state
  uint32_t next;    // next edge of the same source state (kNil ends the list)
};

// Names one edge: an index into the edge arena, or (high bit set) the inline edge of a state.
using EdgeRef = uint32_t;
constexpr EdgeRef kInlineEdge = 0x80000000u;

struct DocRecord {
  uint64_t id;      // engine-wide document id (also its age: smaller is older)
  uint64_t offset;  // start of the document in the packed token arena, in bytes
  uint64_t length;  // number of tokens
};

// The tokens of a global tree's documents, back to back as LEB128 varints: 1 to 3 bytes per
// token for vocabularies under 2^21 (~2 for BPE ids) instead of 4. Only rebuilds after
// removals and integrity checks read them, sequentially.
class PackedTokens {
 public:
  uint64_t append(const uint32_t* tokens, size_t n);  // returns the byte offset of the first token
  // Decodes n tokens from `offset` (and tells where they end); false when the bytes run out or
  // a varint is malformed.
  bool decode(uint64_t offset, uint64_t n, std::vector<uint32_t>& out, uint64_t* end_offset = nullptr) const;
  size_t bytes() const { return bytes_.capacity(); }
  size_t size_bytes() const { return bytes_.size(); }
  void compact() { bytes_.shrink_to_fit(); }
  Column<uint8_t>& raw() { return bytes_; }
  const Column<uint8_t>& raw() const { return bytes_; }

 private:
  Column<uint8_t> bytes_;
};

// One child of a state, as the drafter sees it.
struct Child {
  uint32_t token;
  uint32_t target;
  uint32_t count;
};

// The best children of a high-degree state, cached because short patterns land on states with
// thousands of children and drafting needs only the top few (and the total count).
struct TopChildren {
  uint64_t total;            // sum of the counts of all children
  std::vector<Child> kids;   // the kTopK best: count descending, then token ascending
};

// Open-addressing map (source state, token) -> edge index for states with many edges.
class HubIndex {
 public:
  EdgeRef find(uint64_t key) const;
  void insert(uint64_t key, EdgeRef edge);
  void clear();
  // Edge arena indices changed: the edge at old index e is now at moved_to[e].
  void remap_edges(const std::vector<uint32_t>& moved_to);
  size_t bytes() const { return keys_.capacity() * 8 + vals_.capacity() * 4; }
  size_t size() const { return size_; }
  void write(IndexWriter& out) const;
  // Reads what write() produced (viewing `mapping`); every value must name an edge of a tree
  // with `states` states and `edges` edges. Throws std::runtime_error otherwise.
  void read(char*& p, const char* end, const std::shared_ptr<void>& mapping, size_t states, size_t edges);

 private:
  void grow();
  Column<uint64_t> keys_;  // kEmptyKey marks a free slot; a power of two long
  Column<uint32_t> vals_;  // the EdgeRef of each key
  size_t size_ = 0;        // keys stored
};

class Automaton {
 public:
  static constexpr uint32_t kHubDegree = 8;      // above this many edges, lookups go through HubIndex
  static constexpr uint32_t kCachedDegree = 16;  // above this many edges, top children are cached
  static constexpr uint32_t kTopK = 64;          // children kept per cached state
  static constexpr uintptr_t kPrefetchBytes = 128;  // distance of prefetch_after's fetches

  // A request tree keeps its tokens as they are (drafting and prompt lookup read them at random);
  // a global tree (`global_tree`) keeps documents, packed tokens and a cache of top children.
  explicit Automaton(bool global_tree = false);
  Automaton(Automaton&&) = default;
  Automaton& operator=(Automaton&&) = default;

  // Request trees: also keep a recency-weighted count per state, each occurrence weighing
  // 2^(-age / half_life) tokens after it (0 turns it off). Must be set while the tree is empty.
  void set_recency(double half_life);
  bool has_recency() const { return !recent_.empty(); }
  // The recency-weighted count of a state, up to a factor shared by every state of this tree.
  double recent_weight(uint32_t s) const { return recent_[s]; }

  // Appends a whole document and records it (global trees).
  void add_document(uint64_t id, const uint32_t* tokens, size_t n);
  // Streams tokens into the single open document (request trees).
  void append(const uint32_t* tokens, size_t n);
  // The tokens of one document (global trees).
  std::vector<uint32_t> document_tokens(const DocRecord& doc) const;

  // Transition lookup; returns kNil when absent.
  uint32_t next(uint32_t state, uint32_t token) const;
  // Children of a state (unsorted).
  void children(uint32_t state, std::vector<Child>& out) const;
  // Cached best children of a state with more than kCachedDegree edges; nullptr when the state
  // is small or caching is off. Thread-safe for concurrent readers.
  const TopChildren* top_children(uint32_t state) const;
  // Advances a matching-statistics cursor (state, matched length) by one context token.
  void step(uint32_t& state, int32_t& matched, uint32_t token) const;
  // State whose class contains the suffix of length `len` of the string ending at `state`.
  uint32_t ancestor_for_length(uint32_t state, int32_t len) const;

  const State& state(uint32_t s) const { return states_[s]; }
  // A chain of solid edges (a document being copied) runs through consecutive states, one or
  // two apart: fetching a few cache lines past `s` makes the next steps of a draft hit in cache
  // instead of waiting for memory one dependent load at a time.
  void prefetch_after(uint32_t s) const {
    const uintptr_t at = reinterpret_cast<uintptr_t>(states_.data() + s);
    __builtin_prefetch(reinterpret_cast<const void*>(at + kPrefetchBytes));
    __builtin_prefetch(reinterpret_cast<const void*>(at + 2 * kPrefetchBytes));
  }
  bool has_children(uint32_t s) const { return states_[s].target0 != kNil; }
  uint32_t degree(uint32_t s) const { return states_[s].degree; }  // saturates at 255
  uint32_t last() const { return last_; }
  size_t num_states() const { return states_.size(); }
  size_t num_edges() const { return edges_.size(); }
  size_t num_tokens() const { return num_tokens_; }
  const Column<DocRecord>& docs() const { return docs_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }  // request trees only (empty otherwise)
  size_t bytes() const;
  // Releases spare capacity (after a rebuild, so that the budget counts only what is used) and
  // hands freed heap pages back to the system.
  void compact();

  // Full structural check; returns an empty string when sound, else the first problem found.
  std::string check() const;
  // What loading checks (sequential, O(n)): every stored index is in range, so no lookup can
  // leave the arrays; the file's checksum stands for the rest.
  std::string check_bounds() const;
  // Recounts every occurrence from the stored tokens and compares with `occ` (tests only: O(n)).
  std::string check_counts() const;

  // Serialization of the raw arrays (the engine adds framing); arrays start at multiples of 8
  // bytes from the payload's start so that a mapped file can be used in place.
  void write(IndexWriter& out) const;
  // Takes the arrays write() produced in [p, end) as views of `mapping` (which must be
  // writable and private, and 8-byte aligned where `out` began); advances p. Throws
  // std::runtime_error on inconsistency (bounds only: see check_bounds); never reads outside.
  void read(char*& p, const char* end, const std::shared_ptr<void>& mapping);

 private:
  void extend(uint32_t token);
  uint32_t new_state(int32_t len, int32_t link, uint32_t occ);
  void add_edge(uint32_t from, uint32_t token, uint32_t to);
  EdgeRef find_edge(uint32_t from, uint32_t token) const;
  uint32_t& target_of(EdgeRef e) { return e & kInlineEdge ? states_[e & ~kInlineEdge].target0 : edges_[e].target; }
  void copy_edges(uint32_t from, uint32_t to);
  void index_hub(uint32_t state);
  void cluster_edges();

  bool global_;                     // global tree (documents, packed tokens) or request tree
  Column<State> states_;            // states_[0] is the root
  Column<Edge> edges_;              // all transitions, chained per source state
  std::vector<uint32_t> tokens_;    // request trees: the context, token by token
  PackedTokens packed_;             // global trees: every document, back to back
  uint64_t num_tokens_ = 0;         // tokens indexed
  Column<DocRecord> docs_;          // documents in insertion order (empty for request trees)
  HubIndex hub_;                    // fast lookup for high-degree states
  uint32_t last_ = 0;               // state of the whole current document (append point)
  // Request trees with recency: per state, the sum over its end positions t of 2^(t / half_life)
  // (rescaled now and then; only ratios are read), and the term a new position adds.
  std::vector<double> recent_;
  double recent_gain_ = 1.0;        // 2^(t / half_life) for the next position t
  double recent_step_ = 1.0;        // 2^(1 / half_life)

  struct TopCache {  // filled lazily by readers, emptied by every write
    std::mutex mu;
    std::unordered_map<uint32_t, std::unique_ptr<TopChildren>> by_state;
  };
  std::unique_ptr<TopCache> top_cache_;  // null: caching off (request trees change every step)
};

}  // namespace agentaccel
