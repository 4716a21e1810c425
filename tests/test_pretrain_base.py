"""The pretrained tiny base: its LM examples, its provenance check, the demo's refusal of a stale
base, the synth tokenizer copy and the held-out exclusion of its corpus."""

import dataclasses
import filecmp
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from launch.common import DEFAULT_BASE, DEFAULT_CONFIG, architecture_difference
from rm_jax.data import schema
from rm_jax.data.base_provenance import (PRETRAIN_COMMAND, BaseProvenance, StaleBaseError, check_base,
                                         generator_sha256)
from rm_jax.data import pretrain as pretrain_lib
from rm_jax.data.pretrain import FORM_CHAT, FORM_TRANSCRIPT, PretrainRenderer, form_of
from rm_jax.data.render import Renderer
from rm_jax.data.tokenizer_build import REQUIRED_TOKENIZER_FILES
from rm_jax.model import load_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _samples(synth_dir):
    with open(os.path.join(synth_dir, "samples.jsonl"), "rb") as f:
        return [schema.parse_line(line, line=i + 1, base_dir=synth_dir) for i, line in enumerate(f)]


def test_lm_examples_cover_both_forms_with_every_text_token_a_target_and_no_verdict(tiny_cfg, synth_dir, renderer):
    pre = PretrainRenderer.from_config(tiny_cfg.data, os.path.join(synth_dir, "tokenizer"))
    tok = pre.tokenizer
    forms = set()
    for s in _samples(synth_dir):
        ex = pre.render(s)
        ids, mask = ex.input_ids, ex.target_mask
        assert mask[0] == 0 and ex.verdict_pos == -1 and ex.label == 0
        np.testing.assert_array_equal(mask[1:], (ids[1:] != pre.image_pad_id).astype(np.uint8))
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert '"l3"' not in text, "a verdict reached the base's data"
        form = form_of(s.prompt_id)
        forms.add(form)
        if form == FORM_TRANSCRIPT:   # exactly the judge's input, up to the assistant opener
            np.testing.assert_array_equal(ids, renderer.render(s, with_target=False).input_ids)
        else:
            assert ids[-1] == pre.eos_id and "[user]" not in text   # the policy's own chat, closed
    assert forms == {FORM_CHAT, FORM_TRANSCRIPT}
    assert isinstance(pre, Renderer)


def _fake_base(tmp_path, synth_dir, sha: str) -> str:
    base = tmp_path / "base"
    shutil.copytree(os.path.join(synth_dir, "tokenizer"), base / "hf")
    (base / "hf" / "config.json").write_text("{}")
    BaseProvenance(generator_sha256=sha, data_seed=1, samples=3, excluded_heldout=0, examples={"kept": 3},
                   steps=1, train_loss=1.0, heldout_loss=None, train_seconds=0.0, config_overrides=()).write(str(base))
    return str(base)


def test_check_base_accepts_the_current_generator_and_refuses_another(tmp_path, synth_dir):
    good = _fake_base(tmp_path, synth_dir, generator_sha256())
    assert check_base(good).generator_sha256 == generator_sha256()
    prov = BaseProvenance.read(good)
    dataclasses.replace(prov, generator_sha256="0" * 64).write(good)
    with pytest.raises(StaleBaseError, match=PRETRAIN_COMMAND):
        check_base(good)
    os.remove(os.path.join(good, "base.json"))
    with pytest.raises(FileNotFoundError, match="base.json"):
        check_base(good)


def test_demo_refuses_a_stale_base_before_any_stage(tmp_path, synth_dir):
    base = _fake_base(tmp_path, synth_dir, "f" * 64)
    work = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "launch.demo", f"--workdir={work}", f"--base={base}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "python -m launch.pretrain_base" in r.stderr and "another version of the generator" in r.stderr
    assert not (work / "data").exists()


def test_synth_with_a_tokenizer_copies_it_and_writes_the_same_samples(tmp_path, synth_dir):
    out = tmp_path / "copied"
    src = os.path.join(synth_dir, "tokenizer")
    args = [sys.executable, "-m", "launch.synth", "--n=12", "--seed=5"]
    subprocess.run([*args, f"--out={out}", f"--tokenizer={src}"], cwd=REPO, check=True, capture_output=True)
    subprocess.run([*args, f"--out={tmp_path / 'trained'}"], cwd=REPO, check=True, capture_output=True)
    for name in REQUIRED_TOKENIZER_FILES:
        assert filecmp.cmp(os.path.join(src, name), out / "tokenizer" / name, shallow=False)
    assert (out / "samples.jsonl").read_bytes() == (tmp_path / "trained" / "samples.jsonl").read_bytes()
    r = subprocess.run([*args, f"--out={tmp_path / 'bad'}", f"--tokenizer={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no tokenizer here" in r.stderr


def test_corpus_drops_exactly_the_excluded_requests(tmp_path, synth_dir):
    data = tmp_path / "data"
    data.mkdir()
    with open(os.path.join(synth_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    (data / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    excluded = {pretrain_lib.request_key(rows[0]), pretrain_lib.request_key(rows[-1])}
    path, n, dropped = pretrain_lib.write_corpus(str(data), excluded)
    with open(path) as f:
        kept = [json.loads(line) for line in f]
    assert n == len(rows) and dropped == sum(pretrain_lib.request_key(r) in excluded for r in rows) >= 2
    assert len(kept) + dropped == n
    assert all(pretrain_lib.request_key(r) not in excluded for r in kept)
    assert "[user]" not in pretrain_lib.request_key(rows[0]) and pretrain_lib.request_key(rows[0])


def test_the_committed_base_is_current_and_loads_as_the_tiny_judge():
    """assets/tiny_base must follow the generator and configs/tiny.py: an edit to the synthetic data
    or the tiny model without `python -m launch.pretrain_base` fails here, not in `make demo`."""
    base = os.path.join(REPO, DEFAULT_BASE)
    assert check_base(base).generator_sha256 == generator_sha256()
    assert architecture_difference(os.path.join(base, "hf"), DEFAULT_CONFIG) == []
    load_hf(os.path.join(base, "hf"), dtype="float32")   # raises when a tensor does not fit that architecture


def test_a_base_of_another_architecture_is_named_and_refused(tmp_path):
    """A nested field (the rotary theta) counts; the demo refuses such a base before any stage, as
    it does for another model type."""
    other = tmp_path / "theta_1e4.py"
    other.write_text("from configs import tiny\n\n\ndef get_config():\n    cfg = tiny.get_config()\n"
                     "    cfg.model.text_config.rope_parameters.rope_theta = 10000.0\n    return cfg\n")
    sys.path.insert(0, REPO)
    try:
        assert architecture_difference(os.path.join(REPO, DEFAULT_BASE, "hf"), str(other)) == [
            "text_config.rope_parameters"]
    finally:
        sys.path.remove(REPO)
    work = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "launch.demo", f"--workdir={work}", "--config=configs/tiny_qwen3_5.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    assert "its architecture is not the model of configs/tiny_qwen3_5.py" in r.stderr and "model_type" in r.stderr
    assert "--base=''" in r.stderr and not (work / "data").exists()
