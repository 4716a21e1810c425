"""The policy SFT stage: next-token loss on the passing responses, exported as an HF checkpoint.

  python -m launch.policy_sft --input=FILE --out=DIR [--config=configs/tiny.py] [--steps=400]
      [--init_from=HF_DIR] [--config.train.lr=...]

Writes DIR/shards/ (policy examples: rm_jax/data/policy.py), DIR/train/ (a launch.train run),
DIR/hf/ (launch.convert --to_hf of its last step: what a judge run loads with
--config.train.init_from=DIR/hf) and DIR/policy_cache.json. ``--init_from`` starts the policy from
a pretrained base (an HF dir with the same tokenizer) instead of random init. The stage is cached
by content hash: when the input file, its tokenizer, the config file, the overrides, the start,
the step count and the policy renderer's source are unchanged and DIR/hf exists, nothing runs
again (``--force`` rebuilds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

from absl import app, flags, logging

from launch.common import DEFAULT_CONFIG, REPO_ROOT, define_config_flag, parse_config, run_stage

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (docs/contracts.md)", required=True)
_OUT = flags.DEFINE_string("out", None, "stage directory", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: <input folder>/tokenizer)")
_STEPS = flags.DEFINE_integer("steps", 400, "policy training steps")
_FORCE = flags.DEFINE_bool("force", False, "rebuild even when the cache key matches")
_INIT_FROM = flags.DEFINE_string("init_from", "", "HF checkpoint dir the policy starts from (a pretrained base); "
                                 "'' = random init")
_CONFIG = define_config_flag()

# The policy objective on the judge's trainer: the plain token mean over the response (no verdict
# slot to weight), no oversampling (every example passes), one checkpoint at the end.
POLICY_OVERRIDES = ("train.verdict_weight=1.0", "data.oversample_fail=1", "train.max_target_tokens=192",
                    "train.eval_every=0", "train.keep=1")
_SOURCES = ("rm_jax/data/policy.py", "rm_jax/data/render.py", "launch/policy_sft.py")


def config_overrides(argv: list[str]) -> list[str]:
    """The user's --config.* flags, in order (part of the cache key and passed to launch.train)."""
    return [a for a in argv if a.startswith("--config.")]


def cache_key(input_path: str, tokenizer_dir: str, config_path: str = DEFAULT_CONFIG, overrides: list[str] = (),
              steps: int = 400, init_from: str = "") -> str:
    from rm_jax.utils import file_sha256, tree_sha256
    h = hashlib.sha256()
    parts = {"input": file_sha256(input_path), "tokenizer": tree_sha256(tokenizer_dir),
             "config": file_sha256(config_path), "overrides": list(overrides), "steps": int(steps),
             "policy_overrides": list(POLICY_OVERRIDES),
             "init_from": tree_sha256(init_from) if init_from else "",
             "sources": {p: file_sha256(os.path.join(REPO_ROOT, p)) for p in _SOURCES}}
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()


def cached(out: str, key: str) -> bool:
    path = os.path.join(out, "policy_cache.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(out, "hf", "config.json")):
        return False
    with open(path) as f:
        return json.load(f).get("key") == key


def main(argv):
    from rm_jax.data.render import resolve_tokenizer_dir

    out = os.path.abspath(_OUT.value)
    input_path = os.path.abspath(_INPUT.value)
    if not os.path.isfile(input_path):
        raise app.UsageError(f"--input={_INPUT.value}: no such file (a samples JSONL, docs/contracts.md)")
    config_path = os.path.abspath(flags.FLAGS["config"].config_filename)
    overrides = config_overrides(sys.argv[1:])
    cfg = parse_config(_CONFIG.value)
    tok_dir = os.path.abspath(resolve_tokenizer_dir(_TOKENIZER.value or cfg.data.tokenizer, input_path))
    init_from = os.path.abspath(_INIT_FROM.value) if _INIT_FROM.value else ""
    if init_from and not os.path.isfile(os.path.join(init_from, "config.json")):
        raise app.UsageError(f"--init_from={_INIT_FROM.value}: no HF checkpoint there (no config.json)")
    key = cache_key(input_path, tok_dir, config_path, overrides, _STEPS.value, init_from)
    if not _FORCE.value and cached(out, key):
        print(f"policy stage cached ({key[:12]}): reusing {out}/hf")
        return
    for sub in ("shards", "train", "hf"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    from rm_jax.data.policy import build_policy_shards
    stats = build_policy_shards(input_path, os.path.join(out, "shards"), cfg, tok_dir)
    logging.info("policy shards: %s", {k: stats[k] for k in ("read", "kept", "rejected_by_reason", "splits")})
    pinned = [f"--config.{o}" for o in POLICY_OVERRIDES]
    timings: dict = {}
    run_stage("train", [f"--config={config_path}", f"--workdir={out}/train", f"--config.data.dir={out}/shards",
                        *overrides, *pinned, f"--config.train.init_from={init_from}", f"--config.train.steps={_STEPS.value}",
                        f"--config.train.checkpoint_every={_STEPS.value}"], timings, "policy_train")
    run_stage("convert", ["--to_hf", f"--ckpt={out}/train", f"--out={out}/hf"], timings, "policy_convert")
    logging.info("policy stage seconds: %s", timings)
    with open(os.path.join(out, "policy_cache.json"), "w") as f:
        json.dump({"key": key, "hf_dir": os.path.join(out, "hf"), "steps": _STEPS.value,
                   "shards": {k: stats[k] for k in ("read", "kept", "rejected_by_reason", "splits")}}, f, indent=2)
    print(f"policy checkpoint: {out}/hf (judge: --config.train.init_from={out}/hf)")


if __name__ == "__main__":
    app.run(main)
