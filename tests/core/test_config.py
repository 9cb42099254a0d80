"""Config errors name the bad key path; --set overrides merge before the one conversion."""

from pathlib import Path

import pytest

from protocol.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_shipped_config_loads():
    cfg = load_config(ROOT / "configs" / "qwen.toml")
    assert cfg.model.builtin == "qwen3-small"
    assert cfg.server.port == 30000


def test_defaults_without_a_file():
    assert load_config(None) == Config()


def test_unknown_key_is_named_with_its_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown field `max_runing`.*\$\.scheduler"):
        load_config(write(tmp_path, "[scheduler]\nmax_runing = 3\n"))


def test_unknown_section_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown field `shceduler`"):
        load_config(write(tmp_path, "[shceduler]\n"))


def test_out_of_range_value_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r">= 1.*\$\.scheduler\.max_running_requests"):
        load_config(write(tmp_path, "[scheduler]\nmax_running_requests = 0\n"))
    with pytest.raises(ConfigError, match=r"\$\.server\.port"):
        load_config(None, ["server.port=70000"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"Expected `int`, got `str`.*\$\.server\.port"):
        load_config(None, ["server.port=abc"])


def test_bad_enum_names_the_key():
    with pytest.raises(ConfigError, match=r"\$\.model\.builtin"):
        load_config(None, ["model.builtin=gpt5"])


def test_set_overrides_file_values(tmp_path):
    path = write(tmp_path, "[server]\nport = 1234\n[log]\nlevel = 'debug'\n")
    cfg = load_config(path, ["server.port=0", "log.stderr=false", "model.path=/x/y"])
    assert (cfg.server.port, cfg.log.stderr, cfg.log.level) == (0, False, "debug")
    assert cfg.model.path == "/x/y"


def test_malformed_set_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["nonsense"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="c.toml"):
        load_config(write(tmp_path, "[server\n"))


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.server = None
