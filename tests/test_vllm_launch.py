"""What `serve --backend vllm` and `bench vllm` start vLLM with on a CPU: the KV cache's size. That
vLLM keeps the size given is checked on real servers in tests/test_bench_vllm.py's compare run."""

import pytest

from agentaccel.backends.vllm.backend import _has_cuda, launch_command

pytestmark = pytest.mark.skipif(_has_cuda(), reason="the KV cache's size on a CPU build")


def test_the_kv_cache_is_two_gib_unless_the_environment_or_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    _, env = launch_command("m", 8000, served_name="m", extra_args=[])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    _, env = launch_command("m", 8000, served_name="m", extra_args=[])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "5"


@pytest.mark.parametrize("given", [["--kv-cache-memory-bytes", "536870912"], ["--kv-cache-memory-bytes=512m"]])
def test_a_kv_cache_size_after_the_separator_wins_over_the_gib_variable(given, monkeypatch):
    # vLLM's CPU platform would replace the flag's size with the variable's whole GiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    argv, env = launch_command("m", 8000, served_name="m", extra_args=given)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and argv[-len(given):] == given
