"""A draft model cut from the bundled model (backends/local/draft_model.py): the cut folder is the
target's early exit, loadable as an ordinary model, and bad input is refused by name."""

import json

import pytest
import torch
from safetensors import safe_open

from agentaccel.backends.local.draft_model import cut_model, drafter_folder
from agentaccel.backends.local.model import default_model_folder

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


@pytest.fixture(scope="module")
def target():
    return default_model_folder()


def test_the_cut_model_is_the_targets_early_exit(target, tmp_path):
    from transformers import AutoModelForCausalLM

    out = cut_model(target, 3, tmp_path / "cut3")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["agentaccel_cut_from"]["layers"] == 30
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        layers = {int(name.split(".")[2]) for name in f.keys() if name.startswith("model.layers.")}
    assert layers == {0, 1, 2}
    assert (out / "tokenizer.json").is_file() and not (tmp_path / "cut3.tmp").exists()

    full = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    cut = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 314, 253, 1345, 28, 17, 1064, 30, 2]])
    with torch.inference_mode():
        states = full(ids, output_hidden_states=True).hidden_states
        early = full.lm_head(full.model.norm(states[3]))  # the state after the third layer, through the head
        assert torch.allclose(cut(ids).logits, early, atol=1e-4)
        assert not torch.allclose(cut(ids).logits, full(ids).logits, atol=1e-2)  # and not the whole model


def test_bad_cuts_are_refused_by_name(target, tmp_path):
    for layers in (0, 31):
        with pytest.raises(ValueError, match="cannot keep"):
            cut_model(target, layers, tmp_path / "cut")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: not a model folder"):
        cut_model(tmp_path / "empty", 2, tmp_path / "cut")
    with pytest.raises(ValueError, match="cut:N"):
        drafter_folder("cut:six")
    with pytest.raises(ValueError, match="not a model folder"):
        drafter_folder(tmp_path / "empty")
    assert not (tmp_path / "cut").exists()
