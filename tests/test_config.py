import pytest

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.config import ConfigError, ConfigFieldError, check_range, config_to_dict, parse_overrides
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


STAGES = """loop:
  group_size: 8
  n_batch: 128
  n_minibatch: 64
  n_async: 256
  max_steps: 1000
curriculum:
  - name: longer
    at_step: 100
    l_max: 32768
    l_cache: 8192
  - name: smaller batches
    at_step: 200
    n_batch: 64
    n_minibatch: 64
  - name: typo
    at_step: 300
{bad}
"""


@pytest.mark.parametrize(
    "bad,line,field,why",
    [
        ("    n_minibatch: 48", 18, "curriculum.2.n_minibatch", "must divide n_batch (64)"),
        ("    eps_high: 0.1", 18, "curriculum.2.eps_high", "eps_low"),
        ("    l_cache: 40000", 18, "curriculum.2.l_cache", "l_max=32768"),  # stage 0's l_max carries on
        ("    min_difficulty: 0.9\n    max_difficulty: 0.1", 18, "curriculum.2.min_difficulty", "no problem"),
        ("    n_bach: 32", 18, "curriculum.2.n_bach", "unknown field"),
    ],
)
def test_every_curriculum_stage_is_checked_at_load(tmp_path, bad, line, field, why):
    """A mistake in the third stage fails when the recipe is read, naming its line, not hours in;
    each stage is checked over what the stages before it left."""
    p = write(tmp_path, STAGES.format(bad=bad))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"recipe.yaml:{line}:" in msg and field in msg and why in msg, msg


def test_stage_order_and_reach_are_checked(tmp_path):
    p = write(tmp_path, STAGES.format(bad="    n_async: 512").replace("at_step: 300", "at_step: 150"))
    with pytest.raises(ConfigError, match=r"recipe.yaml:\d+: curriculum.2.at_step: stages apply in order"):
        load_config(p)
    p = write(tmp_path, STAGES.format(bad="    n_async: 512").replace("at_step: 300", "at_step: 5000"))
    with pytest.raises(ConfigError, match="never reached"):
        load_config(p)
    assert load_config(write(tmp_path, STAGES.format(bad="    n_async: 512"))).curriculum[2].n_async == 512


def test_paths_are_checked_when_asked_and_name_their_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    p = write(
        tmp_path, f"model:\n  hf: {tmp_path}\ndata:\n  train: {data}\n  eval: {tmp_path}/missing.jsonl\n"
    )
    load_config(p)  # resolving a recipe for another machine is fine
    with pytest.raises(
        ConfigError, match=r"recipe.yaml:5: data.eval: no such file or folder: .*missing.jsonl"
    ):
        load_config(p, paths=True)
    assert load_config(p, [f"data.eval={data}"], paths=True).data.eval == str(data)


@pytest.mark.fault("input")
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_numbers_are_refused_at_load_naming_the_field(tmp_path, value):
    p = write(tmp_path, f"trainer:\n  optim:\n    warmup_steps: 2\n    lr: {value}\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:4: trainer.optim.lr: must be a finite number"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"algorithm.eps_high: must be a finite number"):
        load_config(None, [f"algorithm.eps_high={value}"])


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(lr=0.0), "lr"),
        (dict(lr=float("inf")), "lr"),
        (dict(min_lr=-1e-7), "min_lr"),
        (dict(min_lr=float("nan")), "min_lr"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(adam_beta1=1.0), "adam_beta1"),
        (dict(adam_beta2=-0.1), "adam_beta2"),
        (dict(adam_eps=0.0), "adam_eps"),
        (dict(clip_grad=0.0), "clip_grad"),
        (dict(clip_grad=float("inf")), "clip_grad"),
        (dict(warmup_steps=-1), "warmup_steps"),
    ],
)
def test_optim_fields_are_range_checked(kwargs, field):
    from megatron_rl.training.config import OptimConfig

    with pytest.raises(ConfigFieldError, match=rf"^{field}: must be"):
        OptimConfig(**kwargs)


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_nonfinite_steps=0), "max_nonfinite_steps"),
        (dict(cpu_threads=-1), "cpu_threads"),
        (dict(seed=-1), "seed"),
    ],
)
def test_trainer_fields_are_range_checked(kwargs, field):
    from megatron_rl.training.config import TrainerConfig

    with pytest.raises(ConfigFieldError, match=rf"^{field}: must be"):
        TrainerConfig(**kwargs)
    assert TrainerConfig().max_nonfinite_steps == 3


def test_check_range_refuses_nan_and_inf_whatever_the_bounds():
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ConfigFieldError, match="x: must be a finite number"):
            check_range("x", value)
    check_range("x", 10**400)  # a huge int is still a number in range (no float overflow)
    with pytest.raises(ConfigFieldError, match=r"eps_high: must be a finite number"):
        GRPOConfig(eps_high=float("inf"))


def test_fleet_group_requests_is_auto_true_or_false(tmp_path):
    assert load_config().fleet.group_requests == "auto"
    for text, want in (("auto", "auto"), ("true", True), ("false", False)):
        assert (
            load_config(write(tmp_path, f"fleet:\n  group_requests: {text}\n")).fleet.group_requests == want
        )
    p = write(tmp_path, "fleet:\n  group_requests: sometimes\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:2: fleet.group_requests"):
        load_config(p)


@pytest.mark.parametrize(
    "urls, why",
    [
        ("['not a url']", r"fleet.urls\[0\]: 'not a url': not a server URL"),
        ("['http://127.0.0.1:30000', 'ftp://h:1']", r"fleet.urls\[1\]: 'ftp://h:1': not a server URL"),
        ("['http://127.0.0.1:99999']", r"fleet.urls\[0\]: .*not a server URL \(Port out of range"),
        ("['http://127.0.0.1:0']", r"fleet.urls\[0\]: .*holds no port 0"),
        ("['http://u:p@127.0.0.1:1']", r"fleet.urls\[0\]: .*holds no port 0, user"),
        ("[3]", r"fleet.urls\[0\]: must be a string"),
        ("http://127.0.0.1:1", r"fleet.urls: must be a list"),
    ],
)
def test_fleet_urls_are_checked_where_the_recipe_is_read(urls, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, [f"fleet.urls={urls}"])


def test_good_fleet_urls_load():
    cfg = load_config(None, ["fleet.urls=['http://127.0.0.1:30000', 'https://[::1]:8443/v1']"])
    assert cfg.fleet.urls == ["http://127.0.0.1:30000", "https://[::1]:8443/v1"]
