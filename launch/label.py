"""Label samples with OpenAI-compatible teachers (vLLM, SGLang, or rm_jax's launch.serve).

  python -m launch.label --input=FILE --out=FILE --endpoint=BASE_URL [--endpoint=...] --model=NAME
      [--image_endpoint=URL --image_model=NAME --concurrency=2 --max_retries=6 --timeout_s=120
       --thumbnail_edge=512 --limit=N]

Writes OUT (each input row with `label` and `label_meta`), OUT.errors.jsonl, OUT.rejects.jsonl
and OUT.stats.json (read = labelled + failed + rejected). OUT may be in any folder: relative
image paths are rewritten to name the same files from there; image URLs stay URLs (the teacher
reads `[image: URL]`, as the judge will). Input rows are streamed: memory follows
--concurrency, not the input's size. A rerun with the same --out resumes:
labelled ids are skipped, failed ones retried, a torn last line (kill -9) repaired. The API key,
when the teachers need one, comes from $OPENAI_API_KEY. Exits 1 when a rerun is needed (samples
still failed after their retries), 2 on a usage error, 0 otherwise (rejected rows are bad input,
listed with their reasons: relabelling cannot fix them).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (docs/contracts.md; labels optional)", required=True)
_OUT = flags.DEFINE_string("out", None, "output JSONL (appended; rerun resumes)", required=True)
_ENDPOINT = flags.DEFINE_multi_string("endpoint", None, "teacher base_url, e.g. http://127.0.0.1:8000/v1 "
                                      "(repeat for shards)", required=True)
_MODEL = flags.DEFINE_string("model", None, "teacher model name (GET BASE_URL/models)", required=True)
_IMAGE_ENDPOINT = flags.DEFINE_string("image_endpoint", None, "image-consistency teacher base_url")
_IMAGE_MODEL = flags.DEFINE_string("image_model", None, "image teacher model (default: --model)")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 2, "requests in flight per endpoint", lower_bound=1)
_MAX_RETRIES = flags.DEFINE_integer("max_retries", 6, "retries per request (429, 5xx, timeouts, "
                                    "connection errors, unreadable replies)", lower_bound=0)
_TIMEOUT = flags.DEFINE_float("timeout_s", 120.0, "deadline of one request attempt, seconds", lower_bound=0.001)
_THUMB = flags.DEFINE_integer("thumbnail_edge", 512, "long edge of the image thumbnails sent, px", lower_bound=8)
_LIMIT = flags.DEFINE_integer("limit", None, "read at most N input rows", lower_bound=0)


def main(argv):
    del argv
    import logging as py_logging
    for name in ("httpx", "httpx2", "openai"):   # one INFO line per request otherwise
        py_logging.getLogger(name).setLevel(py_logging.WARNING)
    from rm_jax.label.client import RetryPolicy
    from rm_jax.label.run import LabelSettings, label_file
    from rm_jax.label.store import OutputCorrupt

    settings = LabelSettings(
        endpoints=tuple(_ENDPOINT.value), model=_MODEL.value, image_endpoint=_IMAGE_ENDPOINT.value,
        image_model=_IMAGE_MODEL.value, concurrency=_CONCURRENCY.value, thumbnail_edge=_THUMB.value,
        limit=_LIMIT.value, policy=RetryPolicy(max_retries=_MAX_RETRIES.value, timeout_s=_TIMEOUT.value),
        api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY", progress=True)
    try:
        stats = label_file(_INPUT.value, _OUT.value, settings)
    except (FileNotFoundError, ValueError, OutputCorrupt) as e:
        logging.error("%s", e)
        sys.exit(2)
    except KeyboardInterrupt:
        # The stats were written (complete: false, the rows not reached as `pending`).
        logging.warning("interrupted; OUT holds every label finished so far: rerun the same command to resume")
        sys.exit(130)
    summary = {k: stats[k] for k in ("read", "labelled", "failed", "rejected", "labelled_this_run",
                                     "already_labelled", "elapsed_s", "throughput_samples_per_s")}
    summary["fail_rate_by_route"] = {r: v["fail_rate"] for r, v in stats["by_route"].items()}
    print(json.dumps(summary))
    print(f"wrote {_OUT.value} (+ .errors.jsonl, .rejects.jsonl, .stats.json)")
    sys.exit(0 if stats["failed"] == 0 else 1)


if __name__ == "__main__":
    app.run(main)
