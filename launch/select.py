"""Pick the scored samples the teacher labels next (active selection).

  python -m launch.select --scores=FILE [--scores=FILE2] --budget=N --out=FILE [--input=SAMPLES]

FILE(s) are launch.score outputs (two: two checkpoints or runs over the same samples). Middle-zone
P(pass) first, then the largest disagreement between the two files after each is standardised on
the ids both scored; the budget is split by route (tool-call / text-only) in proportion to the
candidates; near-duplicate responses of one prompt are dropped. OUT holds the picked samples'
rows (label removed, image paths valid from OUT's folder): a launch.label --input. OUT.stats.json
counts everything and says why each id was picked. The samples come from --input, else from the
first score file's sidecar (FILE.meta.json, written by launch.score).
"""

from __future__ import annotations

from absl import app, flags

_SCORES = flags.DEFINE_multi_string("scores", None, "launch.score output JSONL (once or twice)", required=True)
_BUDGET = flags.DEFINE_integer("budget", None, "samples to select", required=True)
_OUT = flags.DEFINE_string("out", None, "output JSONL (a launch.label input)", required=True)
_INPUT = flags.DEFINE_string("input", "", "the samples JSONL that was scored (default: FILE.meta.json's input)")


def main(argv):
    del argv
    from rm_jax.eval.active import select_file

    stats = select_file(_SCORES.value, _BUDGET.value, _OUT.value, input_path=_INPUT.value)
    print(f"selected {stats['selected']} of {stats['candidates']} candidates (budget {stats['budget']}): "
          f"by reason {stats['by_reason']}, by route {stats['by_route']}, near-duplicates skipped "
          f"{stats['near_duplicates_skipped']}, not scored {stats['not_scored']}")
    print(f"wrote {_OUT.value} and {_OUT.value}.stats.json")


if __name__ == "__main__":
    app.run(main)
