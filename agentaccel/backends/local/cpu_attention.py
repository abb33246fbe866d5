"""Masked attention with grouped KV heads on CPU.

transformers' SDPA path repeats the KV heads (3 -> 9 for SmolLM2) whenever a mask is given,
because CUDA's fused kernels take grouped heads only without one. torch's CPU flash kernel
takes both, with the same result. A verification step always carries its tree mask, so the
repeat copied every layer's whole K and V each step (a 1,536-token context: 7 MB a layer, over
200 MB a step) for nothing. Registered as an attention implementation of its own: steps without
a mask (plain decoding, prefill) run transformers' SDPA function unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

NAME = "agentaccel_cpu_sdpa"


def _attention(sdpa_attention_forward, module, query, key, value, attention_mask, dropout: float = 0.0,
               scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if attention_mask is None or not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_kv_attention(model: torch.nn.Module) -> bool:
    """Switches a CPU model on transformers' SDPA attention to the grouped-KV version (masks are
    built as for SDPA). Returns whether it switched."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    # transformers' function is bound here, once: the attention runs per layer per step
    AttentionInterface.register(NAME, functools.partial(_attention, sdpa_attention_forward))
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
