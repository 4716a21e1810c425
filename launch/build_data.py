"""Build tokenized, split shards from a samples JSONL.

  python -m launch.build_data --input=FILE --out=DIR --config=configs/tiny.py [--tokenizer=DIR]

Writes DIR/{train,heldout}-*.array_record, stats.json, rejects.jsonl, manifest.json and prints
the stats report. Exits 0 when at least one row is valid.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from launch.common import define_config_flag, parse_config

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (DESIGN §4 contract)", required=True)
_OUT = flags.DEFINE_string("out", None, "output directory for shards and reports", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: <input folder>/tokenizer)")
_CONFIG = define_config_flag()


def main(argv):
    del argv
    from rm_jax.data import build as build_lib
    from rm_jax.data.render import Renderer, resolve_tokenizer_dir

    cfg = parse_config(_CONFIG.value)
    if not os.path.isfile(_INPUT.value):
        raise app.UsageError(f"--input={_INPUT.value}: no such file (a samples JSONL, DESIGN §4)")
    tok_dir = resolve_tokenizer_dir(_TOKENIZER.value or cfg.data.tokenizer, _INPUT.value)
    opts = build_lib.BuildOptions.from_config(cfg.data)
    renderer = Renderer.from_config(cfg.data, tok_dir, storage_dtype=opts.pixel_dtype)
    try:
        result = build_lib.build(_INPUT.value, _OUT.value, renderer, opts, config_dict=cfg.to_dict(),
                                 tokenizer_dir=tok_dir, progress=sys.stderr.isatty())
    except ValueError as e:
        logging.error("%s", e)
        sys.exit(1)
    print(build_lib.format_stats(result.stats))
    print(f"wrote {_OUT.value}/ (stats.json, rejects.jsonl, manifest.json, shards)")


if __name__ == "__main__":
    app.run(main)
