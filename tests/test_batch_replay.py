"""The simulated batching server of `bench server --concurrency` (simulation/batch_replay.py) schedules
as vLLM does: prefills chunked to the step's token budget, a prefix cache shared by every request
(blocks of the server's size), clients that take their time between calls."""

from __future__ import annotations

import numpy as np

from agentaccel.engine.cost import Server, StepCostModel
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.speculators import NoSpeculation


def Flat(gap: float = 0.0) -> Server:  # noqa: N802 - reads as the server it makes
    """A step costs 1 s plus 1 ms per token computed."""
    return Server("flat", StepCostModel(tuple(1.0 + 0.001 * np.arange(8193))), 1 << 20, 2048, gap=gap)


def call(n: int, prompt: np.ndarray, output_len: int = 4) -> ReplayCall:
    return ReplayCall(n, n, "s", prompt.astype(np.int32), np.arange(1000, 1000 + output_len, dtype=np.int32))


def plain() -> NoSpeculation:
    return NoSpeculation()


def test_a_long_prefill_is_chunked_to_the_steps_budget():
    rng = np.random.default_rng(0)
    result = br.simulate([[call(0, rng.integers(0, 900, 5000))]], plain(), Flat(), 1, noise=0.0)
    # 5,000 prompt tokens at 2,048 a step: three steps, the third giving the first token; three more decode
    assert result.steps == 3 + 3 and result.tokens == 4
    assert abs(result.seconds - (6 + 0.001 * (5000 + 3))) < 1e-9


def test_the_prefix_cache_is_the_servers_not_a_streams():
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 900, 256)
    first = call(0, np.concatenate([shared, rng.integers(0, 900, 40)]))
    second = call(1, np.concatenate([shared, rng.integers(0, 900, 40)]))  # another session, another stream
    cache = br.server_cache(Flat())
    br.simulate([[first]], plain(), Flat(), 1, noise=0.0, cache=cache)
    assert cache.cached(second.prompt) == 256  # 16 full blocks of 16 tokens in common
    later = br.simulate([[second]], plain(), Flat(), 1, noise=0.0, cache=cache)
    cold = br.simulate([[second]], plain(), Flat(), 1, noise=0.0)
    assert abs((cold.seconds - later.seconds) - 0.256) < 1e-9  # the shared blocks were not computed again


def test_a_stream_waits_its_clients_time_between_calls():
    rng = np.random.default_rng(2)
    calls = [call(n, rng.integers(0, 900, 20), output_len=1) for n in range(3)]
    quick = br.simulate([calls], plain(), Flat(), 1, noise=0.0)
    slow = br.simulate([calls], plain(), Flat(gap=0.5), 1, noise=0.0)
    assert quick.steps == slow.steps == 3
    assert abs(slow.seconds - quick.seconds - 2 * 0.5) < 1e-9  # idle before the second and the third call


def test_the_simulated_learner_is_shown_the_steps_the_plugin_times():
    """The plugin times a step only when one of its requests was in the step before: a prompt's
    prefill alone on the server (its first chunk at one in flight) is never timed, the chunks
    after it are. Two calls of 5,000-token prompts, one stream: 3 chunks and 3 decoding steps
    each; the learner sees every step but each call's first."""
    class Timed(NoSpeculation):
        def __init__(self):
            super().__init__()
            self.seen = []

        def observe(self, timing):
            self.seen.append(timing)

    rng = np.random.default_rng(3)
    method = Timed()
    result = br.simulate([[call(0, rng.integers(0, 900, 5000)), call(1, rng.integers(0, 900, 5000))]], method,
                         Flat(), 1, noise=0.0)
    assert result.steps == 12
    assert [t.tokens for t in method.seen] == [2048, 904, 1, 1, 1] * 2  # no 2,048-token first chunk alone
