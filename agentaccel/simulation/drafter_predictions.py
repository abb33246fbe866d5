"""What a model drafter (a draft model; any causal LM of the store's tokenizer) predicts at each
position of recorded outputs, given the true prefix (teacher forcing): its top tokens and their
probabilities, made once per selection and kept in a file, so that the simulations can draft with
the model without running it (simulation/model_drafter.py says why that is exact for chains).

    agentaccel bench drafter-predictions --db traces.db --source BIRD_DEV/deepseek --limit 3000 \\
        --warm 2700 --out rsl.npz

The model sees each output's prompt through its last `context` tokens (a drafter's window: the
agents' prompts outgrow a small model's), and long outputs in windows of `WINDOW` positions, each
after the `context` tokens before it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WINDOW = 512  # output positions predicted in one forward pass
TOP = 4  # tokens kept per position, most probable first


def digest(prompt: np.ndarray, output: np.ndarray) -> str:
    """The key a call's predictions are kept under: its prompt and its output."""
    h = hashlib.blake2b(digest_size=12)
    h.update(np.asarray(prompt, dtype=np.uint32).tobytes())
    h.update(b"|")
    h.update(np.asarray(output, dtype=np.uint32).tobytes())
    return h.hexdigest()


@dataclass
class DrafterPredictions:
    model: str  # the drafter that predicted
    context: int  # prompt tokens it saw (its window)
    top: dict[str, np.ndarray] = field(default_factory=dict)  # digest -> int32 [output tokens, TOP]
    prob: dict[str, np.ndarray] = field(default_factory=dict)  # digest -> float16 [output tokens, TOP]

    def of(self, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        key = digest(prompt, output)
        return (self.top[key], self.prob[key]) if key in self.top else None

    def save(self, path: Path) -> None:
        keys = sorted(self.top)
        lengths = np.asarray([len(self.top[k]) for k in keys], dtype=np.int64)
        top = np.concatenate([self.top[k] for k in keys]) if keys else np.zeros((0, TOP), np.int32)
        prob = np.concatenate([self.prob[k] for k in keys]) if keys else np.zeros((0, TOP), np.float16)
        with open(path, "wb") as f:  # np.savez would add .npz to a name without it
            np.savez_compressed(f, model=np.asarray(self.model), context=np.asarray(self.context),
                                keys=np.asarray(keys), lengths=lengths, top=top, prob=prob)

    @classmethod
    def load(cls, path: Path) -> DrafterPredictions:
        """A file `save` wrote (ValueError naming the file otherwise)."""
        try:
            data = np.load(path, allow_pickle=False)
            keys, lengths, top, prob = data["keys"], data["lengths"], data["top"], data["prob"]
            out = cls(str(data["model"]), int(data["context"]))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a drafter-predictions file ({e})") from e
        ends = np.cumsum(lengths)
        for key, end, n in zip(keys.tolist(), ends.tolist(), lengths.tolist(), strict=True):
            out.top[key], out.prob[key] = top[end - n:end], prob[end - n:end]
        return out


def predict(calls: Sequence, folder: str | Path | None = None, *, context: int = 1024,
            progress: Callable[[int], None] | None = None) -> DrafterPredictions:
    """The model in `folder` (a folder, "cut:N" or "eagle", backends/local/draft_model.py; default: the
    bundled SmolLM2-135M) on each call's prompt and output (`calls`: simulation/replay.ReplayCall),
    teacher-forced. An EAGLE head runs on the bundled model's states (eagle_head.HeadAsModel)."""
    import torch

    from agentaccel.backends.local.draft_model import drafter_folder
    from agentaccel.backends.local.eagle_head import is_eagle_head, load_as_model
    from agentaccel.backends.local.model import default_model_folder, load_model

    folder = drafter_folder(folder) if folder else default_model_folder()
    model = load_as_model(folder) if is_eagle_head(folder) else load_model(folder)[0]
    out = DrafterPredictions(folder.name, context)
    with torch.inference_mode():
        for call in calls:
            key = digest(call.prompt, call.output)
            out.top[key], out.prob[key] = _teacher_forced(model, call.prompt, call.output, context)
            if progress:
                progress(1)
    return out


def _teacher_forced(model, prompt: np.ndarray, output: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    tokens = np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64)])
    first = len(prompt)  # the index of output[0] in tokens
    tops, probs = [], []
    for start in range(first, len(tokens), WINDOW):
        end = min(start + WINDOW, len(tokens))
        before = max(start - context, 0)
        ids = torch.from_numpy(tokens[before:end - 1]).unsqueeze(0)  # the logit at i predicts token i + 1
        logits = model(input_ids=ids).logits[0, start - 1 - before:]
        p, t = torch.softmax(logits.float(), dim=-1).topk(TOP, dim=-1)
        tops.append(t.to(torch.int32).numpy())
        probs.append(p.to(torch.float16).numpy())
    return np.concatenate(tops), np.concatenate(probs)
