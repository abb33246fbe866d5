"""How often a draft model cut from the served model (backends/local/draft_model.py, `cut:N`) drafts
what the served model writes: on the model's own greedy outputs for `bench vllm`'s workloads (the
calls it sends, prompts cut to their last 768 tokens as it cuts them), the first-choice agreement
of its early exit after N layers at every output position, teacher-forced, and the mean accepted
tokens of its greedy chains of k (the run of agreeing positions from where the chain starts, at
most k: exact for a greedy drafter, simulation/model_drafter.py says why). One forward pass of
the whole model per call gives every N at once (the cut model is that early exit,
tests/test_draft_model.py).

    python scripts/lab/drafter_agreement.py --workloads chat,agent,sql --jobs 12 --layers 2,4,6,8,12,16,20
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from agentaccel.backends.local.draft_model import drafter_folder
from agentaccel.backends.local.eagle_head import load_head, score
from agentaccel.backends.local.model import default_model_folder
from agentaccel.bench.corpus import TracesMissing, default_traces_dir
from agentaccel.bench.vllm.sources import Sources, workload_jobs
from agentaccel.text.render import render_prompt
from agentaccel.text.tokenization import load_tokenizer

KEEP_PROMPT = 768  # bench vllm's --keep-prompt default


def served_calls(model, tok, workload: str, sources: Sources, jobs: int, max_tokens: int) -> list[tuple]:
    """(prompt ids, output ids) of the model's own greedy answers to the workload's first jobs."""
    calls = []

    def generate(messages, stage, n):
        prompt = tok.encode(render_prompt(messages, tok.chat_template))[-KEEP_PROMPT:]
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=min(n, max_tokens), do_sample=False,
                                 eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
        output = out[0, len(prompt):].tolist()
        calls.append((prompt, output))
        return tok.decode(output)

    for job in workload_jobs(workload, sources, jobs, tok, max_tokens, max_tokens):
        job.run(generate)
    return calls


def agreement(model, calls: list[tuple], layers: list[int], chain: int) -> dict[int, dict]:
    """Per layer count: first-choice agreement and mean accepted tokens of a greedy chain of `chain`."""
    hits = {n: [] for n in layers}
    for prompt, output in calls:
        if not output:
            continue
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            out = model(ids, output_hidden_states=True)
            states = out.hidden_states  # [n]: after n layers, before the final norm (but the last)
            rows = slice(len(prompt) - 1, len(prompt) + len(output) - 1)  # the logits that predict the output
            served = out.logits[0, rows].argmax(-1)
            for n in layers:
                early = model.lm_head(model.model.norm(states[n][0, rows])).argmax(-1)
                hits[n].append((early == served).numpy())
    out = {}
    for n, rows in hits.items():
        agree = np.concatenate(rows)
        runs = []  # accepted tokens of a chain started at each position
        for row in rows:
            for i in range(len(row)):
                run = 0
                while run < chain and i + run < len(row) and row[i + run]:
                    run += 1
                runs.append(run)
        out[n] = {"agreement": float(agree.mean()), "accepted_per_chain": float(np.mean(runs)),
                  "positions": int(len(agree))}
    return out


def eagle_agreement(model, head, calls: list[tuple], chain: int) -> dict:
    """An EAGLE head's first-choice agreement (teacher-forced) and the accepted tokens of its own
    greedy chains of `chain` as vLLM runs them (its later tokens from its own states, not the
    model's: eagle_head.score), at every output position."""
    embedding = model.get_input_embeddings().weight.detach()
    agree, accepted = [], []
    for prompt, output in calls:
        if len(output) < 2:
            continue
        ids = torch.tensor(prompt + output)
        with torch.inference_mode():
            out = model(ids[None], output_hidden_states=True)
            states, served = out.hidden_states[-1][0], out.logits[0].argmax(-1)
            starts = torch.arange(len(prompt) - 1, len(ids) - 2)  # from the first output token on
            hits, runs = score(head, embedding, ids, states, served, starts, chain)
            agree.append(hits.numpy())
            accepted.append(runs.numpy())
    agree_all = np.concatenate(agree)
    return {"agreement": float(agree_all.mean()), "accepted_per_chain": float(np.concatenate(accepted).mean()),
            "positions": int(len(agree_all))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="chat,agent,sql")
    parser.add_argument("--jobs", type=int, default=12, help="jobs per workload (sql: questions of 5 calls)")
    parser.add_argument("--layers", default="2,4,6,8,12,16,20,24")
    parser.add_argument("--chain", type=int, default=3, help="tokens a drafter chain drafts (bench vllm's default)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--eagle", help="also an EAGLE head: its folder, or eagle (scripts/train_eagle_head.py's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    folder = default_model_folder()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = load_tokenizer(str(folder))
    layers = [int(x) for x in args.layers.split(",")]
    head = load_head(drafter_folder(args.eagle)) if args.eagle else None
    try:
        traces = default_traces_dir()
    except TracesMissing:  # the bundled workloads
        traces = None
    sources = Sources(traces, None, bundled_agent=traces is None)
    results = {}
    for workload in args.workloads.split(","):
        t0 = time.time()
        calls = served_calls(model, tok, workload, sources, args.jobs, args.max_tokens)
        results[workload] = agreement(model, calls, layers, args.chain)
        if head is not None:
            results[workload]["eagle"] = eagle_agreement(model, head, calls, args.chain)
        print(f"{workload}: {len(calls)} calls, {sum(len(o) for _, o in calls):,} output tokens "
              f"({time.time() - t0:.0f} s)")
        for n, r in results[workload].items():
            name = n if n == "eagle" else f"cut:{n}"
            print(f"  {name:<6} agreement {r['agreement']:.3f}  accepted per chain of {args.chain}: "
                  f"{r['accepted_per_chain']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chain": args.chain, "jobs": args.jobs, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
