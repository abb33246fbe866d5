"""The installed vLLM still has every name the plugin patches or reads, with the parameters it
uses: an upgrade that renames one fails here, with the name, instead of at serve time."""

import pytest

pytest.importorskip("vllm")

from agentaccel.backends.vllm import compat  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def test_installed_vllm_has_what_the_plugin_patches():
    assert compat.problems() == []


def test_a_changed_signature_or_a_missing_name_is_reported(monkeypatch):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    monkeypatch.setattr(InputBatch, "remove_request", lambda self, request_id, force: None)
    monkeypatch.delattr("vllm.config.speculative.has_arctic_inference")
    found = compat.problems()
    assert any("InputBatch.remove_request: parameters" in p for p in found)
    assert any("has_arctic_inference: missing" in p for p in found)
