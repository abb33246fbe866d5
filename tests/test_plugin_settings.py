"""What the vLLM plugin is told arrives whole and typed: PluginSettings round-trips through its
environment variable, and a key it does not know or a value of the wrong type (JSON's "false" is
not false, true is not 1) is refused with one message naming every wrong field."""

import json

import pytest

from agentaccel.backends.vllm.settings import ENV, SWITCH, PluginSettings, plugin_enabled


def read(**given):
    return PluginSettings.from_environ({ENV: json.dumps(given)})


def test_the_settings_round_trip_through_the_environment():
    settings = PluginSettings(db="/tmp/t.db", seed=True, follow=True, memory_budget=1 << 30, step_cost="off",
                              draft_threads=2, follow_log="/tmp/follow.jsonl")
    assert PluginSettings.from_environ(settings.environ()) == settings
    assert PluginSettings.from_environ({}) == PluginSettings()
    assert read(db=None, snapshot=None).db is None


def test_only_what_differs_from_the_defaults_is_written():
    """An earlier release's plugin refuses a name it does not know: settings that use only what it
    knows reach it whole (bench vllm's agentaccel@LABEL serves with one)."""
    settings = PluginSettings(db="/tmp/t.db", seed=True, step_cost="off")
    assert json.loads(settings.environ()[ENV]) == {"db": "/tmp/t.db", "seed": True, "step_cost": "off"}
    assert json.loads(PluginSettings().environ()[ENV]) == {}


@pytest.mark.parametrize(("field", "value", "wanted"), [
    ("seed", "false", "true or false"),  # truthy as a string: the bug this check is for
    ("online", 0, "true or false"),
    ("draft_threads", True, "an integer"),
    ("memory_budget", 1.5, "an integer"),
    ("db", 5, "a string or null"),
    ("step_cost", None, "a string"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value, wanted):
    with pytest.raises(ValueError) as refused:
        read(**{field: value})
    assert str(refused.value) == f"{ENV}: {field} must be {wanted}, got {value!r}"


def test_every_wrong_field_is_named_at_once_and_unknown_keys_are_refused():
    with pytest.raises(ValueError) as refused:
        read(seed="yes", follow="no")
    assert "seed must be true or false" in str(refused.value) and "follow must be true or false" in str(refused.value)
    with pytest.raises(ValueError, match="must be an object of"):
        read(sed=True)
    with pytest.raises(ValueError, match="is not JSON"):
        PluginSettings.from_environ({ENV: "{seed: true"})


def test_the_plugin_switch_is_read_with_the_settings():
    assert plugin_enabled({}) and plugin_enabled({SWITCH: "1"}) and not plugin_enabled({SWITCH: "0"})
