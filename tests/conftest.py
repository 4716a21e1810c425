"""Shared fixtures. Eight CPU devices are emulated; the flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices8():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 emulated CPU devices, got {len(devs)}"
    return devs


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_cfg():
    from launch.common import load_config
    return load_config(os.path.join(REPO, "configs", "tiny.py"))


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """A small synthetic set + its tokenizer, generated once per test session."""
    from rm_jax.data import synth
    out = tmp_path_factory.mktemp("synth")
    synth.write_dataset(str(out), n=150, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def renderer(tiny_cfg, synth_dir):
    from rm_jax.data.render import Renderer
    return Renderer.from_config(tiny_cfg.data, os.path.join(synth_dir, "tokenizer"), storage_dtype="float16")


@pytest.fixture(scope="session")
def built_shards(tiny_cfg, synth_dir, renderer, tmp_path_factory):
    from rm_jax.data import build
    out = tmp_path_factory.mktemp("shards")
    result = build.build(os.path.join(synth_dir, "samples.jsonl"), str(out), renderer,
                         build.BuildOptions.from_config(tiny_cfg.data),
                         tokenizer_dir=os.path.join(synth_dir, "tokenizer"), progress=False)
    return str(out), result
