"""jsonfast parses and writes what the standard library does, including what orjson refuses."""

import json

import pytest

from agentaccel import jsonfast


@pytest.mark.parametrize("text", ['{"a": [1, 2.5, "é", null, true]}', '{"x": NaN}', '"just a string"',
                                  '{"big": 123456789012345678901234567890, "neg": -18446744073709551617}'])
def test_loads_matches_the_standard_library(text):
    expected = json.loads(text)
    got = jsonfast.loads(text.encode())
    assert repr(got) == repr(expected)  # repr: NaN != NaN


def test_malformed_input_raises_the_standard_error():
    with pytest.raises(json.JSONDecodeError):
        jsonfast.loads(b'{"a": ')


@pytest.mark.parametrize("value", [{"a": [1, "é"]}, {"big": 2**70}])
def test_dumps_round_trips(value):
    assert json.loads(jsonfast.dumps(value)) == value
