"""Build tokenized, split shards from a samples JSONL.

  python -m launch.build_data --input=FILE --out=DIR --config=configs/tiny.py [--tokenizer=DIR]
      [--num_workers=N] [--shard_index=i --num_shards=k] [--merge]

Writes DIR/{train,heldout}-*.array_record, {train,heldout}_index.npz, stats.json, rejects.jsonl,
manifest.json (and DIR/parts/, one summary per chunk of input lines) and prints the stats report.
Exits 0 when at least one row is valid.

--num_workers=N builds N chunks of input lines side by side, each read in order, rendered,
tokenized and written by one worker process (an input shorter than N chunks of
data.shard_max_examples lines leaves workers idle).
--shard_index=i --num_shards=k builds host i's slice into DIR, a folder every host shares; the
slice that finishes last merges (writes the indexes, stats, rejects and manifest over all
slices). `--merge` runs that merge alone, e.g. after a host was restarted. The output is
byte-identical whatever N and k.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

from launch.common import define_config_flag, parse_config
from rm_jax.data import attacks

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (one sample per line)", required=True)
_OUT = flags.DEFINE_string("out", None, "output directory for shards and reports (shared by all slices)",
                           required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: <input folder>/tokenizer)")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 1, "processes that build chunks side by side (1: in this process)",
                                    lower_bound=1)
_SHARD_INDEX = flags.DEFINE_integer("shard_index", 0, "this host's slice, in [0, num_shards)", lower_bound=0)
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 1, "hosts building the same input into the same --out",
                                   lower_bound=1)
_MERGE = flags.DEFINE_bool("merge", False, "only merge the slices already built in --out (builds nothing)")
_CONFIG = define_config_flag()


def main(argv):
    del argv
    from rm_jax.data import build as build_lib
    from rm_jax.data.render import Renderer, resolve_tokenizer_dir

    cfg = parse_config(_CONFIG.value)
    if not os.path.isfile(_INPUT.value):
        raise app.UsageError(f"--input={_INPUT.value}: no such file (a samples JSONL)")
    if _SHARD_INDEX.value >= _NUM_SHARDS.value:
        raise app.UsageError(f"--shard_index={_SHARD_INDEX.value} must be < --num_shards={_NUM_SHARDS.value}")
    tok_dir = resolve_tokenizer_dir(_TOKENIZER.value or cfg.data.tokenizer, _INPUT.value)
    opts = build_lib.BuildOptions.from_config(cfg.data)
    renderer = Renderer.from_config(cfg.data, tok_dir, storage_dtype=opts.pixel_dtype)
    t0 = time.time()
    input_path = _INPUT.value
    if cfg.data.adversarial_rate > 0:
        # Attack variants of training responses, labelled fail, written beside the input (their
        # image paths resolve as the originals' do): the build, and its manifest, read that file.
        input_path, adversarial = attacks.write_adversarial_input(
            _INPUT.value, cfg.data.adversarial_rate, cfg.data.split_seed,
            lambda pid: build_lib.split_of(pid, opts.heldout_fraction, opts.split_seed) == "train")
        os.makedirs(_OUT.value, exist_ok=True)
        with open(os.path.join(_OUT.value, "adversarial.json"), "w") as f:
            json.dump({"input": os.path.abspath(input_path), **adversarial}, f, indent=2)
        print(f"adversarial negatives: {adversarial['added']} added to the training split ({adversarial['by_issue']}) "
              f"-> {input_path}")
    try:
        if _MERGE.value:
            result = build_lib.merge(input_path, _OUT.value, renderer, opts, config_dict=cfg.to_dict(),
                                     tokenizer_dir=tok_dir, num_workers=_NUM_WORKERS.value)
        else:
            result = build_lib.build(input_path, _OUT.value, renderer, opts, config_dict=cfg.to_dict(),
                                     tokenizer_dir=tok_dir, progress=sys.stderr.isatty(),
                                     num_workers=_NUM_WORKERS.value, shard_index=_SHARD_INDEX.value,
                                     num_shards=_NUM_SHARDS.value)
    except ValueError as e:
        logging.error("%s", e)
        sys.exit(1)
    if result is None:
        print(f"slice {_SHARD_INDEX.value}/{_NUM_SHARDS.value} built into {_OUT.value}/ in {time.time() - t0:.1f}s; "
              f"other slices are not finished: the last one merges (or run with --merge)")
        return
    print(build_lib.format_stats(result.stats))
    print(f"wrote {_OUT.value}/ (stats.json, rejects.jsonl, manifest.json, shards) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    app.run(main)
