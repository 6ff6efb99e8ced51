import pytest

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.config import ConfigError, config_to_dict, parse_overrides
from megatron_rl.orchestration.recipe import RunConfig, load_config


def write(tmp_path, text):
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_defaults_are_magistral():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    a = cfg.algorithm
    assert (a.group_norm, a.minibatch_norm, a.loss_norm, a.kl_coef) == ("center", True, "group", 0.0)
    assert a.eps_low == 0.2 and 0.26 <= a.eps_high <= 0.30 and a.filter_tolerance == 0.0


def test_recipe_and_overrides(tmp_path):
    p = write(tmp_path, "algorithm:\n  eps_high: 0.3\nbatching:\n  layout: padded\n")
    cfg = load_config(p, ["batching.token_budget=4096", "algorithm.kl_coef=0.01"])
    assert cfg.algorithm.eps_high == 0.3 and cfg.batching.layout == "padded"
    assert cfg.batching.token_budget == 4096 and cfg.algorithm.kl_coef == 0.01
    assert config_to_dict(cfg)["batching"]["token_budget"] == 4096


def test_unknown_field_names_file_line_and_field(tmp_path):
    p = write(tmp_path, "algorithm:\n  eps_low: 0.2\n  eps_hihg: 0.3\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:3: unknown field 'algorithm.eps_hihg'"):
        load_config(p)


def test_bad_value_names_file_line_and_field(tmp_path):
    p = write(tmp_path, "algorithm:\n  eps_low: 0.2\n  eps_high: 0.1\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:3: algorithm.eps_high: must be >= eps_low"):
        load_config(p)
    p = write(tmp_path, "batching:\n  layout: diagonal\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:2: batching.layout: must be one of"):
        load_config(p)
    p = write(tmp_path, "batching:\n\n  token_budget: lots\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:3: batching.token_budget: expected an integer"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"overrides algorithm.adv_eps=0\).*algorithm.adv_eps: must be in"):
        load_config(None, ["algorithm.adv_eps=0"])


def test_broken_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "algorithm: [\n"))
    with pytest.raises(ConfigError, match="cannot read recipe"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_overrides(["algorithm.eps_high"])


def test_component_config_checks_directly():
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)
