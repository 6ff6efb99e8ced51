"""hf.files.read_config_json: a model folder's config.json is read once, the same way, by convert,
serve-engine, the engine and the run's pre-flight checks; every mistake in it names the file."""

from __future__ import annotations

import pytest

from megatron_rl.errors import InputError
from megatron_rl.hf.files import read_config_json

pytestmark = [pytest.mark.fault("input")]


def _folder(tmp_path, text: str | bytes):
    (tmp_path / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return tmp_path


def test_a_plain_config_is_read(tmp_path):
    assert read_config_json(_folder(tmp_path, '{"vocab_size": 121}'), flag="--model") == {"vocab_size": 121}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_refused_naming_line_and_field(tmp_path, constant):
    text = '{\n  "hidden_size": 32,\n  "rms_norm_eps": ' + constant + ',\n  "vocab_size": 121\n}\n'
    with pytest.raises(InputError, match=rf"config.json:3: -?{constant.lstrip('-')} in field 'rms_norm_eps'"):
        read_config_json(_folder(tmp_path, text), flag="--model")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe{}", r"config.json: not UTF-8 text \(byte 0\)"),
        (b'{"a": 1,\n"b": }', r"config.json:2: invalid JSON"),
        (b"[1, 2]", r"config.json: expected a JSON object, got list"),
        (b"[" * 200_000, r"config.json: nested deeper than"),
    ],
)
def test_a_malformed_config_is_named(tmp_path, content, message):
    with pytest.raises(InputError, match=message):
        read_config_json(_folder(tmp_path, content), flag="--model")


def test_a_folder_without_config_names_the_option(tmp_path):
    with pytest.raises(InputError, match=r"--model .*: no config.json in it"):
        read_config_json(tmp_path, flag="--model")
    with pytest.raises(InputError, match=r"--hf-dir .*: no such folder"):
        read_config_json(tmp_path / "absent", flag="--hf-dir")
