"""Build scalar-RM pair data from a preference JSONL (docs/contracts.md, "Preference contract").

  python -m launch.rm_build --input=FILE --out=DIR [--config=configs/rm_tiny.py --tokenizer=DIR]

Writes DIR/{train,calibration,heldout}-NNNNN.array_record (one record per prompt group) +
{split}_pairs_index.npz, stats.json (truncation / overlength /
missing-EOS rates, filter reasons), rejects.jsonl, manifest.json; prints stats.json.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from launch.common import define_config_flag, parse_config

_INPUT = flags.DEFINE_string("input", None, "preference JSONL", required=True)
_OUT = flags.DEFINE_string("out", None, "output directory", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: <input folder>/tokenizer)")
_CONFIG = define_config_flag("configs/rm_tiny.py")


def main(argv):
    del argv
    from rm_jax.data.render import Renderer, resolve_tokenizer_dir
    from rm_jax.rm import build
    from rm_jax.rm.render import RMRenderer

    cfg = parse_config(_CONFIG.value)
    if not os.path.isfile(_INPUT.value):
        raise app.UsageError(f"--input={_INPUT.value}: no such file (a preference JSONL)")
    tok_dir = resolve_tokenizer_dir(_TOKENIZER.value or cfg.data.tokenizer, _INPUT.value)
    renderer = RMRenderer(Renderer.from_config(cfg.data, tok_dir, storage_dtype="float16"))
    stats = build.build(_INPUT.value, _OUT.value, renderer, build.PairBuildOptions.from_config(cfg.data),
                        tokenizer_dir=tok_dir)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    app.run(main)
