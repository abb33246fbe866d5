"""An EAGLE head for the served model, in the form vLLM's `eagle` method runs (EAGLE-1,
`vllm/model_executor/models/llama_eagle.py`): the next token's embedding and the target's last
hidden state (after its final norm) joined by `fc`, one Llama decoder layer without its input
norm, and the result read through the target's own head (its embeddings: SmolLM2 ties them). From
the state at position p and the token at p+1 it predicts the state at p+1, so the token at p+2;
it drafts a chain by feeding itself its own states.

Nothing here is trained: scripts/train_eagle_head.py trains a head on the target's own states and
writes it with `save_head` into the cache beside the converted model (`<model>-eagle`), where
`drafter_folder("eagle")` finds it. The folder holds only the head's weights (`fc.*`,
`layers.0.*`): vLLM shares the target's embeddings and head with it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

WEIGHTS = "model.safetensors"
_CHAINS_AT_ONCE = 64  # chains stepped together (each holds a copy of the sequence's keys)
MARK = "agentaccel_eagle_for"  # config.json key: the target the head was trained for (and what the folder is)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        hidden, self.heads, self.kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or hidden // self.heads
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim),
                             persistent=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding, halves rotated (Llama's, and vLLM's neox style)."""
        angles = positions.float()[..., None] * self.inv_freq  # [..., T, head_dim / 2]
        angles = torch.cat([angles, angles], -1)[..., None, :, :]  # [..., 1, T, head_dim]: one for all heads
        cos, sin = angles.cos(), angles.sin()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `x` [B, T, H] at `positions` [B, T], as [B, heads, T, head_dim]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return self._rotate(q, positions), self._rotate(k, positions), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`mask`: True where a query may see a key ([.., Tq, Tk]); None: causal over equal lengths."""
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               scale=1.0 / math.sqrt(self.head_dim))
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        hidden, inner = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A Llama decoder layer whose input norm is gone (EAGLE's first layer: `fc` feeds it)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = _MLP(c)


class EagleHead(nn.Module):
    """The head's own weights; the target's embeddings are passed in (frozen, shared)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = dict(config)
        self.fc = nn.Linear(2 * config["hidden_size"], config["hidden_size"], bias=False)
        self.layers = nn.ModuleList([_Layer(config)])

    def forward(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The predicted next states [B, T, H] for the next tokens' `embeds` and the target's (or its
        own) `states` at `positions`; with `past` (keys, values of earlier positions) and `mask`
        (which of past + these each query sees), a step of a chain. Also this call's keys and values."""
        layer = self.layers[0]
        x = self.fc(torch.cat([embeds, states], -1))
        q, k, v = layer.self_attn.project(x, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        x = x + layer.self_attn.attend(q, keys, values, mask)
        return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)


def from_target(target, init_layer: int | None = None) -> EagleHead:
    """A head shaped for the HF model `target` that starts as the identity on the state: its layer
    a copy of the target's layer `init_layer` (default: the last) with its output projections at
    zero (that layer's updates are sized for the target's residual stream, hundreds of times the
    final state's scale), `fc` passing the state through with a little of the token. Training
    grows the layer's part from there."""
    config = target.config.to_dict()
    head = EagleHead(config)
    source = target.model.layers[config["num_hidden_layers"] - 1 if init_layer is None else init_layer]
    mine = head.layers[0]
    copy_layer(source, mine)
    with torch.no_grad():
        mine.self_attn.o_proj.weight.zero_()
        mine.mlp.down_proj.weight.zero_()
        hidden = config["hidden_size"]
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
        head.fc.weight[:, :hidden].normal_(0.0, 0.01)
    return head


def copy_layer(source: nn.Module, dest: nn.Module) -> None:
    """The weights of a Llama decoder layer (the head's, or transformers') into another, input norm
    aside (the head has none)."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dest.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dest.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        dest.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)


def save_head(head: EagleHead, target_folder: Path, out: Path) -> Path:
    """The head as vLLM's `eagle` method reads it: a config naming the target's architecture with
    one layer, and the head's weights only. Written beside `out` and renamed (never half a head)."""
    from safetensors.torch import save_file

    config = json.loads((target_folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    config[MARK] = target_folder.name
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(tmp / WEIGHTS),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def load_head(folder: Path) -> EagleHead:
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if MARK not in config:
        raise ValueError(f"{folder}: not an EAGLE head made by agentaccel (no {MARK} in its config.json)")
    head = EagleHead(config)
    head.load_state_dict(load_file(str(folder / WEIGHTS)))
    return head.eval()


def is_eagle_head(folder: Path) -> bool:
    try:
        return MARK in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


class HeadAsModel(nn.Module):
    """The head behind a causal LM's interface, teacher-forced: `logits[j]` predicts token j + 1
    from the target's state at j - 1 and token j (position 0, which has no state before it, takes
    the target's own logits). What bench drafter-predictions runs a drafter through."""

    def __init__(self, target, head: EagleHead) -> None:
        super().__init__()
        self.target, self.head = target, head

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        embedding = self.target.get_input_embeddings().weight
        out = self.target(input_ids=input_ids, output_hidden_states=True)
        positions = torch.arange(input_ids.shape[1] - 1).expand(input_ids.shape[0], -1)
        guess, _ = self.head(embedding[input_ids[:, 1:]], out.hidden_states[-1][:, :-1], positions)
        return SimpleNamespace(logits=torch.cat([out.logits[:, :1], guess @ embedding.T], 1))


def load_as_model(folder: Path, target_folder: Path | None = None) -> HeadAsModel:
    """The head in `folder` with its target (default: the bundled model) as one teacher-forced model."""
    from agentaccel.backends.local.model import default_model_folder, load_model

    target, _ = load_model(target_folder or default_model_folder())
    return HeadAsModel(target, load_head(folder)).eval()


@torch.inference_mode()
def greedy_chains(head: EagleHead, embedding: torch.Tensor, tokens: torch.Tensor, states: torch.Tensor,
                  starts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's greedy chains of `k` from each start: the tokens [n, k] and the states they were
    read from [n, k, H], as vLLM runs it. From position p the first token comes from the target's
    state there and the token at p+1 (so it drafts token p+2); each later one from the head's own
    last state and drafted token, at the next position, seeing the target-fed keys up to p and its
    own since. `tokens` [T], `states` [T, H] the target's final states, `embedding` [V, H] the
    target's (tied) embeddings; every start below T - 1."""
    positions = torch.arange(len(tokens) - 1)
    out, (keys, values) = head(embedding[tokens[1:]][None], states[:-1][None], positions[None])
    parts = [_chains(head, embedding, out[0], keys, values, starts[i:i + _CHAINS_AT_ONCE], k)
             for i in range(0, len(starts), _CHAINS_AT_ONCE)]
    if not parts:
        return torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k, out.shape[-1])
    return torch.cat([t for t, _ in parts]), torch.cat([s for _, s in parts])


def _chains(head: EagleHead, embedding: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            starts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(starts)
    state = out[starts]
    token = (state @ embedding.T).argmax(-1)
    chain, chain_states = [token], [state]
    seen = (torch.arange(keys.shape[2])[None, :] <= starts[:, None])[:, None, None, :]  # [n, 1, 1, T-1]
    past_k, past_v = keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)
    for j in range(1, k):
        mask = torch.cat([seen, torch.ones(n, 1, 1, j, dtype=torch.bool)], -1)
        nxt, (k1, v1) = head(embedding[token][:, None], state[:, None], (starts + j)[:, None],
                             past=(past_k, past_v), mask=mask)
        past_k, past_v = torch.cat([past_k, k1], 2), torch.cat([past_v, v1], 2)
        state = nxt[:, 0]
        token = (state @ embedding.T).argmax(-1)
        chain.append(token)
        chain_states.append(state)
    return torch.stack(chain, 1), torch.stack(chain_states, 1)


def score(head: EagleHead, embedding: torch.Tensor, tokens: torch.Tensor, states: torch.Tensor,
          served: torch.Tensor, starts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From each start p (below T - 1), the head's greedy chain of `k` (greedy_chains) against the
    target's choices: whether its first token is the target's (`served[p+1]`, `served[i]` the
    target's greedy token after position i), and its accepted tokens: its j-th token is accepted
    while it equals the target's choice for token p+2+j (`served[p+1+j]`) and every one before it was."""
    chains, _ = greedy_chains(head, embedding, tokens, states, starts, k)
    after = starts[:, None] + 1 + torch.arange(k)[None, :]
    hits = (chains == served[after.clamp(max=len(served) - 1)]) & (after < len(served))
    return hits[:, 0], hits.long().cumprod(1).sum(1)
