"""The typed run config: parsed once from the ml_collections file and its --config.a.b=v
overrides; unknown keys and impossible combinations refused with their path and reason."""

import dataclasses
import json
import os

import pytest
from absl import flags
from ml_collections import config_flags

from rm_jax.model.config import ConfigError
from rm_jax.run_config import (DataSection, RunConfig, TrainSection, adopt_init_config, describe, model_config,
                               parse)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("tiny", "rm_tiny", "qwen3_vl_30b_a3b", "qwen3_5_35b_a3b")


def _load(name):
    from launch.common import load_config
    return load_config(os.path.join(REPO, "configs", f"{name}.py"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_parses_and_round_trips(name):
    """What a manifest records (to_dict) is the file's dict, and parses back into the same record."""
    cfg = _load(name)
    run = parse(cfg)
    plain = lambda d: json.loads(json.dumps(d, default=list))
    recorded, given = plain(run.to_dict()), plain(cfg.to_dict())
    for section, values in given.items():      # every key as the file gives it (the rest: defaults)
        assert (recorded[section] if not isinstance(values, dict)
                else {k: recorded[section][k] for k in values}) == values, section
    assert parse(recorded) == run
    assert (run.rm is not None) == (name == "rm_tiny")


def test_every_field_has_a_default_and_a_description():
    lines = describe()
    assert len(lines) > 60
    for line in lines:
        path, _, rest = line.partition(" = ")
        assert rest.split("  # ", 1)[1].strip(), f"{path} has no description"
    for cls in (RunConfig, TrainSection, DataSection):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name


@pytest.mark.parametrize("path, value, match", [
    ("train.stpes", 3, r"unknown config key train\.stpes"),
    ("data.image.max_pixel", 3, r"unknown config key data\.image\.max_pixel"),
    ("moe.capacity", 1.0, r"unknown config key moe\.capacity"),
    ("mesh.gpus", 8, r"unknown config key mesh\.gpus"),
    ("train.steps", "3", r"train\.steps='3': expected an integer"),
    ("train.lr", "fast", r"train\.lr='fast': expected a number"),
    ("train.async_checkpoint", 1, r"train\.async_checkpoint=1: expected true or false"),
    ("data.buckets", 128, r"data\.buckets=128: expected a list"),
])
def test_unknown_keys_and_wrong_kinds_are_refused_with_their_path(path, value, match):
    cfg = _load("tiny").to_dict()       # a manifest's dict: ConfigDict itself keeps each key's type
    *sections, key = path.split(".")
    node = cfg
    for name in sections:
        node = node[name]
    node[key] = value
    with pytest.raises(ValueError, match=match):
        parse(cfg)


def test_unknown_top_level_key_is_refused():
    cfg = _load("tiny").to_dict()
    cfg["trian"] = {}
    with pytest.raises(ConfigError, match="unknown config key trian"):
        parse(cfg)


@pytest.mark.parametrize("changes, match", [
    (dict(global_batch=16, grad_accum=3), "global_batch=16 is not divisible by train.grad_accum=3"),
    (dict(eval_every=-1), r"train\.eval_every=-1: must be >= 0"),
    (dict(attention="flash"), r"train\.attention='flash'; expected one of"),
])
def test_impossible_combinations_are_refused_with_the_reason(changes, match):
    cfg = _load("tiny")
    cfg.train.update(changes)
    with pytest.raises(ConfigError, match=match):
        parse(cfg)


def test_model_section_is_checked_by_its_architecture():
    cfg = _load("tiny")
    cfg.model.model_type = "llama"
    with pytest.raises(ValueError, match="llama"):
        parse(cfg)
    cfg = _load("tiny")
    cfg.moe.backend = "a2a"
    with pytest.raises(ConfigError, match=r"moe\.backend='a2a'"):
        parse(cfg)


def test_command_line_overrides_reach_the_typed_record():
    """`--config=configs/X.py --config.a.b=v`, parsed by absl as the launchers parse it."""
    argv = ["prog", f"--config={os.path.join(REPO, 'configs', 'tiny.py')}", "--config.train.steps=7",
            "--config.data.image.max_pixels=4096", "--config.mesh.fsdp=2", "--config.moe.lb_coef=0.5",
            "--config.model.text_config.num_hidden_layers=3", "--config.data.buckets=(128,256)"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "run config", flag_values=fv, lock_config=False, sys_argv=argv)
    fv(argv)
    run = parse(fv.config)
    assert (run.train.steps, run.data.image.max_pixels, run.mesh.fsdp, run.moe.lb_coef) == (7, 4096, 2, 0.5)
    assert run.data.buckets == (128, 256)
    assert model_config(run).text.num_hidden_layers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.steps = 8


def test_adopting_an_init_checkpoint_returns_a_new_record(tmp_path):
    """train.init_from: the checkpoint's config.json becomes the model section of a new record;
    the original is untouched."""
    cfg = _load("tiny")
    hf = cfg.model.to_dict()
    hf["text_config"]["hidden_size"] = 48
    hf["text_config"]["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(hf, default=list))
    cfg.train.init_from = str(tmp_path)
    run = parse(cfg)
    adopted = adopt_init_config(run)
    assert adopted is not run and adopted.train == run.train and adopted.data == run.data
    assert model_config(adopted).text.hidden_size == 48 and model_config(adopted).text.num_hidden_layers == 2
    assert model_config(run).text.hidden_size == 64
    plain = parse(_load("tiny"))
    assert adopt_init_config(plain) is plain          # no init_from: the record itself
