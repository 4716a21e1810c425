"""Check teacher labels before training on them.

  python -m launch.validate_labels --labels=FILE [--previous=FILE] --out=DIR

Writes DIR/report.md, DIR/report.json (with "flags": [{"name", "detail"}], names
text_only_flat_vs_similarity, route_fail_rate_ratio, tool_issue_on_text_only), DIR/plots/*.png
and DIR/examples/similarity_*.jsonl. Prints the flags; exits 0 either way (flags are findings
to read, not errors), 2 when --labels cannot be read.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

_LABELS = flags.DEFINE_string("labels", None, "labelled samples JSONL (launch.label's OUT)", required=True)
_PREVIOUS = flags.DEFINE_string("previous", None, "an earlier labelling of the same ids (migration matrix)")
_OUT = flags.DEFINE_string("out", None, "report folder", required=True)


def main(argv):
    del argv
    from rm_jax.label.report import write_report
    from rm_jax.label.validate import validate

    for name, path in (("labels", _LABELS.value), ("previous", _PREVIOUS.value)):
        if path and not os.path.isfile(path):
            logging.error("--%s=%s: no such file", name, path)
            sys.exit(2)
    report = validate(_LABELS.value, _PREVIOUS.value)
    write_report(report, _OUT.value)
    for b in report.bins:
        print(f"similarity {b.name}: n={b.n} fail rate "
              f"{'-' if b.fail_rate is None else f'{100 * b.fail_rate:.1f}%'}")
    for f in report.flags:
        print(f"FLAG {f.name}: {f.detail}")
    if not report.flags:
        print("no flags")
    print(f"wrote {_OUT.value}/report.md, report.json, plots/, examples/")


if __name__ == "__main__":
    app.run(main)
