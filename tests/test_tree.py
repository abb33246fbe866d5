"""Tree-verification inputs: who sees whom, and at which position."""

import pytest

torch = pytest.importorskip("torch")

from agentaccel.backends.local.tree import tree_inputs, visibility  # noqa: E402


def test_each_node_sees_the_pending_token_its_ancestors_and_itself_and_pads_only_themselves():
    # pending -> a(0) -> b(1); a(0) -> c(2); pending -> d(3); then two pad rows
    parents = [-1, 0, 0, -1]
    seen = visibility(parents, 7)
    rows = [set(torch.nonzero(row).flatten().tolist()) for row in seen]
    assert rows == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 4}, {5}, {6}]


def test_tree_inputs_put_the_draft_after_the_cache():
    pos, mask = tree_inputs([-1, 0, 0, -1], past=3, device=torch.device("cpu"))
    assert pos.tolist() == [[3, 4, 5, 5, 4]]  # the cache length + depth
    assert mask.shape == (1, 1, 5, 8) and mask[0, 0, :, :3].all()  # every row sees the cache
    assert torch.equal(mask[0, 0, :, 3:], visibility([-1, 0, 0, -1], 5))
    pos, mask = tree_inputs([], past=3, device=torch.device("cpu"))
    assert pos.tolist() == [[3]] and mask is None  # a plain step needs no mask
