"""One speculator interface (simulation/speculator.py): the per-call replay and the batched
server drive every drafter, the per-request ones and the vLLM plugin's batch drafter alike."""

from __future__ import annotations

import numpy as np
import pytest
from traces_fixtures import repetitive_store

from agentaccel.engine.cost import parse
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation import methods
from agentaccel.simulation import replay as rp
from agentaccel.simulation import speculators as sp
from agentaccel.simulation.speculator import Batch, Chain, PerRequest, Speculator
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore

GPU = parse("gpu")
H100 = parse("llama-3.1-8b@h100")


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    db = repetitive_store(tmp_path_factory.mktemp("store"), n=40)
    with TraceStore(db) as store:
        return rp.load_calls(store, load_tokenizer())


def every_kind():
    """Per-request drafters (chains and trees), the tree oracle, the plugin's batch drafter (with
    and without the step budget) and the allocation oracle."""
    return [*methods.build(["none", "ngram-tuned", "paper-tree", "agentaccel-embedded", "oracle-1"], GPU),
            *methods.build(["agentaccel-request", "agentaccel", "oracle"], H100)]


def test_every_speculator_runs_in_the_per_call_replay_and_in_the_batched_server(calls):
    output_tokens = sum(len(c.output) for c in calls)
    per_call = rp.replay(calls, every_kind())
    batched = {s.name: br.simulate(br.sessions_of(calls), s, H100, 4, noise=0.0) for s in every_kind()}
    for name, result in batched.items():
        t = per_call[name]["*"]
        assert t.tokens == output_tokens and result.tokens == output_tokens, name
        assert t.calls == result.calls == len(calls), name
        assert t.accepted <= t.drafted and result.accepted <= result.drafted, name
        if name in ("oracle-1", "oracle"):  # the two ceilings draft only what is accepted, per call too
            assert t.accepted == t.drafted
        if name == "none":
            assert t.drafted == result.drafted == 0
        else:  # the outputs repeat: every drafter gets tokens accepted, whichever drives it
            assert t.accepted > 0 and result.accepted > 0, name


def test_the_tree_oracle_bounds_every_drafter_in_the_batched_server_too(calls):
    """oracle-1 drafts only what will be accepted, the longest continuation the trees hold: run
    in the batched server one stream at a time, no drafter takes fewer decoding steps."""
    sessions = br.sessions_of(calls)
    oracle = br.simulate(sessions, sp.TreeOracle(1), H100, 1, noise=0.0)
    # every draft token is right; the server counts a call's last token as its step's own, not as accepted
    assert oracle.accepted > 0 and oracle.drafted - oracle.accepted <= oracle.calls
    for drafter in [sp.embedded(GPU), *methods.build(["agentaccel-request", "agentaccel"], H100)]:
        result = br.simulate(sessions, drafter, H100, 1, noise=0.0)
        assert oracle.request_steps <= result.request_steps, drafter.name
        assert result.tokens == oracle.tokens


def test_the_known_token_ceilings_climb_from_the_budget_to_the_allocation_oracle(calls):
    """oracle-known-K: the plugin's budget under the true step cost, knowing whether each
    candidate's first K tokens will be accepted. Knowing none it allocates as agentaccel-known does
    (on candidates grown further); each token known more gives it more, up to the oracle, and it
    never drafts a token among the first K that the model rejects."""
    sessions = br.sessions_of(calls)
    names = ["agentaccel-known", "oracle-known-0", "oracle-known-1", "oracle-known-2", "oracle-known-8", "oracle"]
    verified: dict[str, list[tuple[int, int]]] = {}
    rate = {}
    for m in methods.build(names, H100):
        seen = verified.setdefault(m.name, [])
        m.accepted = lambda key, draft, accepted, seen=seen: seen.append((len(draft), accepted))
        rate[m.name] = br.simulate(sessions, m, H100, 8, noise=0.0).row()["tokens_per_s"]
    assert abs(rate["oracle-known-0"] / rate["agentaccel-known"] - 1) < 0.03, rate
    assert rate["oracle-known-0"] < rate["oracle-known-1"] <= rate["oracle-known-2"] <= rate["oracle-known-8"], rate
    assert rate["oracle-known-8"] <= rate["oracle"] * 1.001, rate
    for k in (1, 2, 8):  # what it knows it never gets wrong: each draft's first k tokens are accepted
        steps = verified[f"oracle-known-{k}"]
        assert sum(drafted > 0 for drafted, _ in steps) > 10
        assert all(accepted >= min(drafted, k) for drafted, accepted in steps), k
    assert any(accepted < min(drafted, 1) for drafted, accepted in verified["oracle-known-0"])


def test_the_per_call_replay_drives_the_plugins_drafter_as_vllm_does(calls):
    """vLLM asks its proposer for nothing before a request's first token: the batch drafter's
    first step of every call drafts nothing, later ones draft from the earlier calls' outputs."""
    def first_steps(spec) -> tuple[list[int], rp.Tally]:
        tally, firsts = rp.Tally(), []
        for call in calls:
            firsts.append(len(tally.drafted_per_step))
            rp.run_call(spec, f"c{call.call_id}", call, tally, None)
        return [tally.drafted_per_step[i] for i in firsts], tally

    drafts, tally = first_steps(methods.build(["agentaccel-request"], H100)[0])
    assert drafts == [0] * len(calls)
    assert sum(tally.drafted_per_step) > 0 and tally.accepted > 0
    drafts, _ = first_steps(sp.embedded(GPU))  # the per-call replay's own drafters draft at the prefill
    assert sum(drafts) > 0


class Recorder(PerRequest):
    """What a per-request speculator is told, in order."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self.events.append(("begin", key, len(prompt), max_total))

    def advance(self, key, tokens):
        self.events.append(("advance", key, tokens.tolist()))

    def propose(self, key):
        self.events.append(("propose", key))
        return super().propose(key)

    def end(self, key):
        self.events.append(("end", key))


def test_a_per_request_speculator_is_told_each_requests_tokens_once_and_asked_only_when_a_draft_is_wanted():
    call = rp.ReplayCall(1, 1, "s", np.arange(10, dtype=np.uint32), np.arange(100, 105, dtype=np.uint32))
    rec = Recorder()
    rp.run_call(rec, "a", call, rp.Tally(), None)
    advanced = [t for e in rec.events if e[0] == "advance" for t in e[2]]
    assert advanced == list(range(100, 105))  # every output token once, the last ones before `end`
    assert rec.events[0] == ("begin", "a", 10, 15) and rec.events[-1] == ("end", "a")
    assert [e[0] for e in rec.events[1:3]] == ["propose", "advance"]  # the prefill's draft, from the prompt alone
    assert rec.events[-2][0] == "advance"  # the last tokens in: no draft asked for

    rec = Recorder()
    result = br.simulate([[call]], rec, H100, 2, noise=0.0)
    advanced = [t for e in rec.events if e[0] == "advance" for t in e[2]]
    assert advanced == list(range(100, 105)) and result.tokens == 5
    kinds = [e[0] for e in rec.events]
    assert kinds[0] == "begin" and kinds[1] == "advance"  # the server drafts after the first token, not at prefill
    assert kinds[-1] == "end" and kinds[-2] == "advance"


def test_a_draft_longer_than_the_row_allows_is_cut_and_stays_a_tree():
    class Wide(PerRequest):
        name = "wide"

        def propose(self, key):
            return Chain(list(range(20)))

    batch = Batch.empty(1, 16)
    batch.keys[0], batch.num_tokens[0], batch.sampled[0] = "a", 10, [5]
    (draft,) = Wide().step(batch)
    assert list(draft.token_ids) == list(range(5)) and list(draft.parents) == [-1, 0, 1, 2, 3]
    batch.done[0] = True
    assert list(Wide().step(batch)[0].token_ids) == []


def test_one_registry_names_every_drafter_of_every_command_and_each_name_is_one_thing():
    """`bench replay`, `bench server` and the rest build from simulation/methods.py: a name means
    the same drafter in each (`agentaccel`: the vLLM plugin's batch drafter, also per call)."""
    names = list(dict.fromkeys([*methods.PER_CALL, *methods.DEFAULT, "agentaccel-seeded", "agentaccel-known",
                                "agentaccel-off", "ngram", "agentaccel-embedded-shared",
                                "agentaccel-embedded-tenants", "oracle-1", "oracle-2"]))
    kinds = []
    for server in (GPU, H100):
        built = methods.build(names, server)
        assert all(isinstance(s, Speculator) for s in built)
        assert [s.name for s in built] == names
        kinds.append([type(s) for s in built])
    assert kinds[0] == kinds[1]
    assert type(methods.build(["agentaccel"], GPU)[0]) is sp.Drafter
    assert type(methods.build(["agentaccel-embedded"], GPU)[0]) is sp.Suffix
    with pytest.raises(ValueError, match="unknown method"):
        methods.build(["pld"], H100)
