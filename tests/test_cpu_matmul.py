"""Few-row products (backends/local/cpu_matmul.py: the native kernel, or weight-first in torch
without it) give the stock results; the kernel computes every row exactly as it would alone."""

import pytest
import torch

from agentaccel.backends.local.cpu_matmul import HEAD_ROWS, KERNEL_ROWS, _kernels, route_small_batches

needs_kernel = pytest.mark.skipif(_kernels() is None, reason="the native kernel needs an x86 CPU with AVX2 and FMA")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_routed_linear_matches_stock_for_every_row_count(bias, use_kernel):
    lin = torch.nn.Linear(52, 98, bias=bias)  # inner 52: the kernel's 8-wide loop leaves a tail; 98 rows of W too
    model = torch.nn.Sequential(lin)
    stock = {rows: torch.nn.functional.linear(x, lin.weight, lin.bias)
             for rows in range(1, max(HEAD_ROWS[1], KERNEL_ROWS) + 8)
             for x in [torch.randn(1, rows, 52, generator=torch.Generator().manual_seed(rows))]}
    assert route_small_batches(model, use_kernel=use_kernel) == 1
    assert type(model[0]) is torch.nn.Linear
    for rows, want in stock.items():
        x = torch.randn(1, rows, 52, generator=torch.Generator().manual_seed(rows))
        got = model(x)
        assert got.shape == want.shape
        assert got.is_contiguous()  # row-major like the stock result: SDPA's fused kernel needs it
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_rows_are_bit_identical_alone_and_together():
    """A verification step's pending-token row must equal a plain step's: same products, same
    summation order, whatever the rows beside it (or a non-contiguous input)."""
    lin = torch.nn.Linear(576, 1536, bias=False)
    route_small_batches(torch.nn.Sequential(lin))
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(33)])
        for rows in (2, 3, 8, 17, 33):
            assert torch.equal(lin(x[:rows]), alone[:rows]), rows
        strided = x.t().contiguous().t()  # the same values, column-major
        assert not strided.is_contiguous()
        assert torch.equal(lin(strided), alone)
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, lin.weight), rtol=1e-4, atol=1e-4)
        # More rows than one pass of the kernel keeps (64; the backend sends those to torch): the
        # kernel itself still handles them, group by group, with the same per-row results.
        many = torch.cat([x, x, x[:4]])
        out = torch.empty(len(many), 1536)
        _kernels().linear_into(many.data_ptr(), len(many), 576, lin.weight.data_ptr(), 1536, out.data_ptr())
        assert torch.equal(out, torch.cat([alone, alone, alone[:4]]))


def test_routed_model_keeps_tied_weights_and_greedy_output():
    model = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.inference_mode():
        want_logits = model(prompt).logits
        want = model.generate(prompt, max_new_tokens=12, do_sample=False)
    changed = route_small_batches(model)
    assert changed == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        torch.testing.assert_close(model(prompt).logits, want_logits, rtol=1e-4, atol=1e-5)
        for rows in (2, 3, 4):  # a verification step's few rows, over a cache
            out = model(prompt[:, :-rows], use_cache=True)
            step = model(prompt[:, -rows:], past_key_values=out.past_key_values).logits
            torch.testing.assert_close(step, want_logits[:, -rows:], rtol=1e-4, atol=1e-5)
        assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), want)


def test_grouped_kv_attention_gives_the_same_tree_step_logits():
    from transformers import DynamicCache

    from agentaccel.backends.local.cpu_attention import NAME, use_grouped_kv_attention
    from agentaccel.backends.local.tree import tree_inputs

    model = tiny_llama()  # 4 query heads over 2 KV heads: the repeat is what the switch avoids
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 11, 23]])
    parents = [-1, 0, 0, 1, -1]  # a tree: two roots, a branching node
    draft = torch.tensor([[8, 40, 41, 77, 90, 12]])  # the pending token, then the draft

    def tree_step_logits():
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            pos, mask = tree_inputs(parents, prompt.shape[1], torch.device("cpu"))
            return model(input_ids=draft, position_ids=pos, attention_mask=mask, past_key_values=cache,
                         use_cache=True).logits

    want = tree_step_logits()
    assert use_grouped_kv_attention(model) and model.config._attn_implementation == NAME
    torch.testing.assert_close(tree_step_logits(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_cost_profiles_are_cached_per_kind_of_products(use_kernel):
    """A kernel whose speed changed must not draft on the curve cached for the previous one."""
    from agentaccel.backends.local.cost_curve import cached_profile_path, device_tag

    model = tiny_llama()
    route_small_batches(model, use_kernel=use_kernel)
    kernels = _kernels() if use_kernel else None
    want = f"cpu-kernel-v{kernels.VERSION}" if kernels is not None else "cpu"
    assert device_tag(model) == want
    assert cached_profile_path("smollm2", device_tag(model)).name == f"smollm2-{want}.json"
    assert device_tag(tiny_llama()) == "cpu"  # not routed: torch's products
