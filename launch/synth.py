"""Writes the embedded default data set: DIR/samples.jsonl, DIR/images/, DIR/tokenizer/.

    python -m launch.synth --out=DIR --n=N [--seed=S] [--fail_rate=0.08] [--rule_violation_rate=0.03]
        [--tokenizer=DIR]

--tokenizer copies an existing tokenizer (a pretrained base's HF dir) into DIR/tokenizer instead of
training one on this data, so the data is read with the base's own ids.

Same seed, same bytes (see rm_jax/data/synth.py for how labels avoid surface shortcuts).
"""

import os

from absl import app, flags, logging

from rm_jax.data import synth
from rm_jax.data.tokenizer_build import copy_tokenizer_dir

_OUT = flags.DEFINE_string("out", None, "output folder", required=True)
_N = flags.DEFINE_integer("n", 2000, "number of samples (responses; 3 per prompt)")
_SEED = flags.DEFINE_integer("seed", 0, "random seed")
_FAIL_RATE = flags.DEFINE_float("fail_rate", 0.08, "probability that a response is a failure")
_RULES = flags.DEFINE_float("rule_violation_rate", 0.03, "share of responses with a rule violation "
                            "(malformed call, unknown tool, missing required argument, duplicate call)")
_VOCAB = flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size (<= the tiny model's)")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "copy this tokenizer (dir or HF checkpoint dir) instead of training one")


def main(argv):
    del argv
    summary = synth.write_dataset(_OUT.value, _N.value, seed=_SEED.value, fail_rate=_FAIL_RATE.value,
                                  vocab_size=_VOCAB.value, with_tokenizer=not _TOKENIZER.value,
                                  rule_violation_rate=_RULES.value)
    if _TOKENIZER.value:
        copy_tokenizer_dir(_TOKENIZER.value, os.path.join(_OUT.value, "tokenizer"))
    logging.info("wrote %s: %s", _OUT.value, summary)
    print(summary)


if __name__ == "__main__":
    app.run(main)
