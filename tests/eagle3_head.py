"""An EAGLE-3 head for a Llama-family target, in the checkpoint layout vLLM's `eagle3` method loads
(`LlamaForCausalLMEagle3`: one decoder layer over the token's embedding beside `fc` of three of the
target's hidden states, its own norm and lm_head), untrained but not random: `fc` passes on the
last of the three states (the target's layer n-3, vLLM's default) and the layer adds nothing to it
(its output projections are zero), so the head predicts what the target's own norm and lm_head read
from that earlier layer: chains that are sometimes right, which is what a plumbing test needs."""

from __future__ import annotations

import json
from pathlib import Path

AUX_STATES = 3  # vLLM's default for a Llama target: layers 2, n // 2 and n - 3


def eagle3_head(target_folder: Path, out: Path) -> Path:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((target_folder / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    with safe_open(str(target_folder / "model.safetensors"), "pt") as f:
        embed, norm = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("model.norm.weight")
    rng = torch.Generator().manual_seed(0)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=rng) * 0.02

    fc = torch.zeros(hidden, AUX_STATES * hidden)
    fc[:, (AUX_STATES - 1) * hidden:] = torch.eye(hidden)
    weights = {
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        # the first layer attends over the token's embedding and the state side by side (2 x hidden)
        "midlayer.self_attn.q_proj.weight": small(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": small(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": small(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": small(inter, hidden),
        "midlayer.mlp.up_proj.weight": small(inter, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, inter),
        "fc.weight": fc,
        "norm.weight": norm.float().clone(),
        "lm_head.weight": embed.float().clone(),  # the target ties its lm_head to its embedding
    }
    head_config = {**config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                   "draft_vocab_size": config["vocab_size"], "target_hidden_size": hidden,
                   "tie_word_embeddings": False}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head_config, indent=2))
    return out
