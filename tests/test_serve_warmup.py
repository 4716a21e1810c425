"""The shape ladder (rm_jax.serve.warmup): once it is compiled, real traffic compiles nothing."""

import os

import pytest

from rm_jax.data.schema import Sample, read_samples
from rm_jax.score.scorer import ScoreMode
from rm_jax.serve.stream import ScoreStream
from rm_jax.serve.warmup import CompileCounter, image_rungs, shape_ladder, warm_ladder
from serve_fixtures import small_scorer


@pytest.mark.slow
def test_after_the_ladder_real_requests_compile_nothing(tiny_cfg, renderer, synth_dir):
    scorer = small_scorer(tiny_cfg, renderer, batch_size=4)
    shapes = shape_ladder(scorer, modes=(ScoreMode.P_PASS,))
    assert image_rungs(scorer)[0] == 0 and len(image_rungs(scorer)) > 2
    assert {s.bucket for s in shapes} == set(scorer.buckets) and any(s.width for s in shapes)
    got = warm_ladder(scorer, shapes)
    assert got["shapes"] == len(shapes) and got["compiles"] > 0
    counter = CompileCounter.install()
    before = counter.compiles
    # real samples: GRPO groups with and without images, lone samples, in requests of mixed sizes
    samples = [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)][:60]
    stream = ScoreStream(scorer, lambda kind, smp, results: list(results), max_wait_s=0.0)
    answers, k = [], 0
    for n in (1, 7, 3, 12, 2, 9, 5, 21):
        answers += stream.admit(len(answers), ScoreMode.P_PASS, samples[k:k + n], since=0.0)
        k += n
    while stream.pending or stream.inflight:
        if not (stream.inflight < stream.depth and stream.dispatch(1e9, flush=True)):
            answers += stream.collect()
    assert all(err is None for _, _, err in answers)
    assert sum(len(a) for _, a, _ in answers) == k
    assert counter.compiles == before, f"{counter.compiles - before} compiles after the ladder"
