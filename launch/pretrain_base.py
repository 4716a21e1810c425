"""Pretrain the embedded default's tiny base LM once: next-token loss on synthetic conversations.

  python -m launch.pretrain_base [--out=assets/tiny_base] [--workdir=runs/pretrain_base] [--n=40000]
      [--seed=1000003] [--steps=4000] [--config=configs/tiny.py] [--config.train.lr=...]

Users start a judge from a pretrained model, never from random weights; this gives the embedded
default the same start. Stages:
  1. launch.synth's generator writes N samples at its default failure rate (seed --seed, not the
     demo's), with a tokenizer trained on them: the base's tokenizer, which the demo then copies
     (launch.synth --tokenizer=OUT/hf) so every stage reads the same ids;
  2. samples whose user request also occurs among the held-out prompts of the demo's data
     (--exclude_seed, --exclude_n, --exclude_fail_rate: launch.demo's defaults) are dropped, so the
     base never reads what the demo evaluates on;
  3. the rest become LM examples (rm_jax.data.pretrain: the policy's chat format or the judge's
     transcript format, all text tokens targets, no verdicts) and train from random init;
  4. the last step is exported as a complete HF dir (safetensors, config, tokenizer, image
     processor) to OUT/hf, with the provenance in OUT/base.json; launch.demo refuses a base whose
     recorded generator hash differs from rm_jax/data/synth.py today.
Rerunning resumes the training run in WORKDIR/train.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from absl import app, flags

from launch.common import REPO_ROOT, define_config_flag, parse_config, run_stage
from rm_jax.data.base_provenance import BaseProvenance, generator_sha256
from rm_jax.data.pretrain import build_pretrain_shards, heldout_request_keys, write_corpus
from rm_jax.train.metrics_log import read_metrics

_OUT = flags.DEFINE_string("out", os.path.join(REPO_ROOT, "assets", "tiny_base"), "where the base is written")
_WORKDIR = flags.DEFINE_string("workdir", "runs/pretrain_base", "data, shards and the training run")
_N = flags.DEFINE_integer("n", 40000, "synthetic samples of the base's corpus")
_SEED = flags.DEFINE_integer("seed", 1000003, "generator seed of the corpus (not a demo seed)")
_FAIL_RATE = flags.DEFINE_float("fail_rate", 0.08, "failure rate of the corpus's responses (the generator's default)")
_STEPS = flags.DEFINE_integer("steps", 4000, "next-token training steps")
_EXCLUDE_SEED = flags.DEFINE_integer("exclude_seed", 0, "seed of the demo data whose held-out prompts are excluded")
_EXCLUDE_N = flags.DEFINE_integer("exclude_n", 10000, "size of that demo data")
_EXCLUDE_FAIL = flags.DEFINE_float("exclude_fail_rate", 0.3, "its failure rate")
_CONFIG = define_config_flag()

# The base's objective on the judge's trainer: the plain token mean over every text token.
BASE_OVERRIDES = ("train.verdict_weight=1.0", "data.oversample_fail=1", "train.init_from=", "train.keep=2",
                  "train.eval_every=1000", "train.eval_batches=16", "train.warmup_steps=100")


def heldout_requests(work: str, cfg) -> set[str]:
    """The user requests of the demo data's held-out prompts (launch.synth as the demo runs it, and
    the demo's split rule)."""
    out = os.path.join(work, "exclude")
    run_stage("synth", [f"--out={out}", f"--n={_EXCLUDE_N.value}", f"--seed={_EXCLUDE_SEED.value}",
                        f"--fail_rate={_EXCLUDE_FAIL.value}"], {}, "exclude_synth")
    return heldout_request_keys(os.path.join(out, "samples.jsonl"), cfg.data.heldout_fraction, cfg.data.split_seed)


def main(argv):
    del argv
    work, out = os.path.abspath(_WORKDIR.value), os.path.abspath(_OUT.value)
    cfg = parse_config(_CONFIG.value)
    config_path = os.path.abspath(flags.FLAGS["config"].config_filename)
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    data, shards, run = (os.path.join(work, d) for d in ("data", "shards", "train"))
    if not os.path.isfile(os.path.join(data, "corpus.jsonl")):
        run_stage("synth", [f"--out={data}", f"--n={_N.value}", f"--seed={_SEED.value}",
                            f"--fail_rate={_FAIL_RATE.value}"], {}, "corpus_synth")
        corpus, n, dropped = write_corpus(data, heldout_requests(work, cfg))
        with open(os.path.join(data, "corpus.json"), "w") as f:
            json.dump({"samples": n, "excluded_heldout": dropped}, f)
    with open(os.path.join(data, "corpus.json")) as f:
        counts = json.load(f)
    print(f"corpus: {counts['samples']} samples, {counts['excluded_heldout']} dropped for a held-out request")
    tok_dir = os.path.join(data, "tokenizer")
    if not os.path.isfile(os.path.join(shards, "manifest.json")):
        stats = build_pretrain_shards(os.path.join(data, "corpus.jsonl"), shards, cfg, tok_dir)
    with open(os.path.join(shards, "stats.json")) as f:
        stats = json.load(f)
    print(f"LM examples: read {stats['read']}, kept {stats['kept']}, rejected {stats['rejected_by_reason']}")
    pinned = [f"--config.{o}" for o in BASE_OVERRIDES]
    timings: dict = {}
    t0 = time.time()
    run_stage("train", [f"--config={config_path}", f"--workdir={run}", f"--config.data.dir={shards}", *overrides,
                        *pinned, f"--config.train.max_target_tokens={cfg.data.max_len}",
                        f"--config.train.steps={_STEPS.value}", "--config.train.checkpoint_every=500"],
              timings, "base_train")
    train_seconds = time.time() - t0
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run_stage("convert", ["--to_hf", f"--ckpt={run}", f"--out={out}/hf"], timings, "base_convert")
    rows = read_metrics(run)
    train_loss = next(r["loss"] for r in reversed(rows) if "loss" in r)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    BaseProvenance(generator_sha256=generator_sha256(), data_seed=_SEED.value, samples=counts["samples"],
                   excluded_heldout=counts["excluded_heldout"],
                   examples={k: stats[k] for k in ("read", "kept", "rejected_by_reason", "splits")},
                   steps=_STEPS.value, train_loss=float(train_loss), heldout_loss=float(val[-1]) if val else None,
                   train_seconds=round(train_seconds, 1), config_overrides=tuple(overrides)).write(out)
    print(f"base: {out} (train loss {train_loss:.4f}, held-out loss {val[-1] if val else float('nan'):.4f})")


if __name__ == "__main__":
    app.run(main)
