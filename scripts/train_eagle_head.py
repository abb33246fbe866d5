"""Trains an EAGLE head for the bundled model (backends/local/eagle_head.py) on the model's own
states over recorded calls, and writes it where `--drafter eagle` finds it (the cache, beside the
converted model).

The data: calls of a trace store (`agentaccel import-traces ../shared/traces`), taken in turn from
each source family (agent, SQL, chat...) until --tokens; each call's prompt rendered with the
model's chat template and its recorded answer, cut to its last --seq tokens. One pass of the
target over each gives, at every position, its final state and its distribution over the next
token (its --top-k most likely, with their probabilities): what the head learns to predict one position ahead (its
state, smooth L1; its distribution, cross-entropy weighted --token-weight, as EAGLE does), from
the state at the position before and the token between, with noise on the states it is given so
that it learns to continue from its own. The target stays frozen; only the head's `fc` and layer
train (AdamW, cosine).

Measured after every epoch on calls held out: those of every 20th session (`--held-out session`,
the default: an agent's later calls repeat its earlier ones, so a call held out from a session
the head learned from is not unseen), or every 20th call (`--held-out call`): the head's
first-choice agreement with the target, teacher-forced, and the accepted tokens of its own greedy
chains of --chain as vLLM runs them (eagle_head.score), on the held-out calls' answers only.

    python scripts/train_eagle_head.py --store traces.db --tokens 400000 --epochs 3
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.progress import Progress

from agentaccel.backends.local.eagle_head import from_target, load_head, save_head, score
from agentaccel.backends.local.model import default_model_folder
from agentaccel.text.render import render_prompt
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore

UNROLL_DECAY = 0.8  # a later step of an unrolled chain weighs this much less than the one before


def family(source: str | None) -> str:
    """A call's source family: the first folder of its source file (swe-agent, text2sql, chat...)."""
    parts = [p for p in (source or "").replace("\\", "/").split("/") if p and p not in (".", "..")]
    for known in ("swe-agent", "openhands", "text2sql", "chat"):
        if known in parts:
            return known
    return parts[0] if parts else "live"


def last_messages(messages: list[dict], chars: int) -> list[dict]:
    """The last messages, as many as reach `chars` of text (only a prompt's end is kept: an agent's
    history need not be rendered and tokenized whole)."""
    kept, total = [], 0
    for message in reversed(messages):
        kept.append(message)
        total += len(str(message.get("content") or ""))
        if total >= chars:
            break
    return kept[::-1]


def sequences(store_path: str, tok, seq: int, budget: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(tokens, where the answer starts, its session) of calls taken in turn from each family, up to
    `budget` tokens."""
    by_family: dict[str, list] = defaultdict(list)
    with TraceStore(store_path, create=False) as store:
        for call in store.iter_calls(baselines=True):
            if call.response:
                by_family[family(call.source_file)].append(call)
    rng = random.Random(seed)
    for calls in by_family.values():
        rng.shuffle(calls)
    out, total, turn = [], 0, 0
    pools = [calls for calls in by_family.values() if calls]
    while total < budget and any(pools):
        calls = pools[turn % len(pools)]
        turn += 1
        if not calls:
            continue
        call = calls.pop()
        prompt = tok.encode(render_prompt(last_messages(call.messages, 8 * seq), tok.chat_template))
        answer = tok.encode(call.response + "<|im_end|>")
        ids = (prompt + answer)[-seq:]
        if len(ids) < 16:
            continue
        out.append((ids, max(0, len(ids) - len(answer)), call.session_id))
        total += len(ids)
    print(f"{len(out)} calls, {total:,} tokens from " + ", ".join(f"{f} ({len(c)} left)" for f, c in by_family.items()))
    return out


@torch.inference_mode()
def target_pass(model, ids: list[int], top_k: int) -> dict:
    """The target's final states, greedy choices and top-k distribution at every position."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    logprobs = out.logits[0].float().log_softmax(-1)
    top = logprobs.topk(top_k, -1)
    return {"ids": torch.tensor(ids), "states": out.hidden_states[-1][0].half(), "served": top.indices[:, 0],
            "top_ids": top.indices.int(), "top_logprobs": top.values.half()}


def head_loss(head, embedding, item: dict, noise: float, token_weight: float,
              unroll: int = 1) -> tuple[torch.Tensor, float]:
    """The loss on one sequence: from (state p, token p+1) the state and distribution at p+1; with
    `unroll` > 1, again from its own predicted state at p+1 and token p+2, and so on, as it drafts
    a chain (EAGLE-3's training-time test, by positions: each step's keys are that step's own),
    step j weighted UNROLL_DECAY^j. The agreement is the first step's."""
    ids, states = item["ids"], item["states"].float()
    given = states[:-1] + noise * torch.randn_like(states[:-1]) * states[:-1].std()
    total, agree = 0.0, 0.0
    for j in range(min(unroll, len(ids) - 2)):
        out, _ = head(embedding[ids[1 + j:]][None], given[None], torch.arange(j, len(ids) - 1)[None])
        out = out[0]  # the predicted states at 1 + j ..
        regression = torch.nn.functional.smooth_l1_loss(out, states[1 + j:])
        logprobs = (out @ embedding.T).log_softmax(-1)  # [T-1-j, V]
        weights = item["top_logprobs"][1 + j:].float().exp()  # the target's top-k there
        cross = -(weights * logprobs.gather(1, item["top_ids"][1 + j:].long())).sum(-1).mean()
        total = total + UNROLL_DECAY ** j * (regression + token_weight * cross)
        if j == 0:
            agree = (logprobs.argmax(-1) == item["served"][1:]).float().mean().item()
        given = out[:-1]  # its own state at 1 + j, for token 2 + j
    return total, agree


def evaluate(head, embedding, items: list[dict], chain: int) -> dict:
    """On held-out calls' answers: teacher-forced agreement and accepted tokens per chain."""
    agree, accepted = [], []
    head.eval()
    with torch.inference_mode():
        for item in items:
            ids, states, served, start = item["ids"], item["states"].float(), item["served"], item["answer_at"]
            rows = torch.arange(max(start - 1, 0), len(ids) - 2)
            if len(rows):
                hits, runs = score(head, embedding, ids, states, served, rows, chain)
                agree.append(hits.float())
                accepted.append(runs.float())
    head.train()
    agree_all, acc_all = torch.cat(agree), torch.cat(accepted)
    return {"agreement": agree_all.mean().item(), "accepted_per_chain": acc_all.mean().item(),
            "positions": len(agree_all)}


def split(items: list[dict], by: str) -> tuple[list[dict], list[dict]]:
    """(held out, learned from): every 20th session's calls (`by` "session"), or every 20th call."""
    if by == "call" or any("session" not in item for item in items):
        if by == "session":
            print("these target passes were kept without their sessions: every 20th call held out")
        return items[::20], [item for i, item in enumerate(items) if i % 20]
    sessions = sorted({item["session"] for item in items})
    held = set(sessions[::20])
    return [i for i in items if i["session"] in held], [i for i in items if i["session"] not in held]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="a trace store of recorded calls")
    parser.add_argument("--tokens", type=int, default=400_000, help="tokens of calls to learn from")
    parser.add_argument("--seq", type=int, default=1024, help="each call cut to its last N tokens")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--top-k", type=int, default=16, help="the target's distribution kept per position")
    parser.add_argument("--token-weight", type=float, default=0.1, help="cross-entropy's weight beside the states'")
    parser.add_argument("--noise", type=float, default=0.05, help="noise on the given states, times their spread")
    parser.add_argument("--chain", type=int, default=3, help="drafted tokens per chain, measured")
    parser.add_argument("--out", help="where the head goes (default: the cache, beside the model: <model>-eagle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features", help="keep the target's passes in this file (made once, read after)")
    parser.add_argument("--unroll", type=int, default=1,
                        help="chain steps trained on the head's own states (1: the next state only)")
    parser.add_argument("--init", help="start from this trained head (default: the identity on the state)")
    parser.add_argument("--held-out", choices=("session", "call"), default="session",
                        help="what is held out for the measure: every 20th session's calls, or every 20th call")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    folder = default_model_folder()
    out = Path(args.out) if args.out else folder.with_name(f"{folder.name}-eagle")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = load_tokenizer(str(folder))
    embedding = model.get_input_embeddings().weight.detach()
    if args.features and Path(args.features).is_file():
        items = torch.load(args.features)
        print(f"{len(items)} calls' target passes from {args.features}")
    else:
        data = sequences(args.store, tok, args.seq, args.tokens, args.seed)
        items = []
        t0 = time.time()
        with Progress() as bar:
            task = bar.add_task("the target's states", total=sum(len(ids) for ids, _, _ in data))
            for ids, answer_at, session in data:
                items.append({**target_pass(model, ids, args.top_k), "answer_at": answer_at, "session": session})
                bar.advance(task, len(ids))
        print(f"target passes: {time.time() - t0:.0f} s")
        if args.features:
            torch.save(items, args.features)
    held, train = split(items, args.held_out)
    print(f"held out: {len(held)} calls ({args.held_out}s), {len(train)} to learn from")
    head = load_head(Path(args.init)).train() if args.init else from_target(model)
    before = evaluate(head, embedding, held, args.chain)
    print(f"the head before training: agreement {before['agreement']:.3f}, accepted per chain of {args.chain} "
          f"{before['accepted_per_chain']:.2f} ({before['positions']:,} held-out answer positions)")
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * len(train)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    best = None
    for epoch in range(args.epochs):
        random.Random(args.seed + epoch).shuffle(train)
        t0, seen, agree_sum = time.time(), 0, 0.0
        with Progress() as bar:
            task = bar.add_task(f"epoch {epoch + 1}", total=len(train))
            for item in train:
                loss, agree = head_loss(head, embedding, item, args.noise, args.token_weight, args.unroll)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                seen += 1
                agree_sum += agree
                bar.advance(task)
        result = evaluate(head, embedding, held, args.chain)
        print(f"epoch {epoch + 1}: {time.time() - t0:.0f} s, training agreement {agree_sum / seen:.3f}; held out: "
              f"agreement {result['agreement']:.3f}, accepted per chain of {args.chain} "
              f"{result['accepted_per_chain']:.2f}")
        if best is None or result["accepted_per_chain"] > best:
            best = result["accepted_per_chain"]
            save_head(head, folder, out)
    print(f"the head: {out} (held-out accepted per chain of {args.chain}: {best:.2f})")


if __name__ == "__main__":
    main()
