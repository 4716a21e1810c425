"""Continuous batching (rm_jax.serve.stream) on a real tiny judge, in-process: requests whose
samples are scored in device batches formed across requests get the rows of scoring each request
alone, in order, and GRPO groups split over requests still share one prefix prefill."""

import asyncio
import dataclasses
import os
import threading

import numpy as np
import pytest

from serve_fixtures import small_scorer

from rm_jax.data.schema import Sample, read_samples
from rm_jax.score.scorer import ScoreMode

BATCH = 4


@pytest.fixture(scope="module")
def scorer(tiny_cfg, renderer):
    return small_scorer(tiny_cfg, renderer, batch_size=BATCH)


@pytest.fixture(scope="module")
def requests(synth_dir, scorer):
    """Consecutive samples cut into requests of 1-5: GRPO groups (p*-s0, -s1, ...) split over
    requests, images and text mixed, and one sample that cannot be rendered."""
    got = [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)][:20]
    bad = next(k for k, smp in enumerate(got) if smp.images)
    got[bad] = dataclasses.replace(got[bad], base_dir="/nonexistent")      # its image cannot be read
    sizes, out, k = [1, 5, 2, 3, 1, 4, 4], [], 0
    for n in sizes:
        out.append(got[k:k + n])
        k += n
    return out


@pytest.fixture(scope="module")
def alone_p_pass(scorer, requests):
    """Each request's P(pass) scored alone: the reference of the p_pass stream tests."""
    return [scorer.p_pass(r) for r in requests]


def _drain(stream, admitted):
    """Run the stream to the end as the worker does: dispatch while fewer than depth are in
    flight, collect otherwise; returns {token: (answer, error)}."""
    done = {}
    for token, kind, samples in admitted:
        for t, answer, err in stream.admit(token, kind, samples, since=0.0):
            done[t] = (answer, err)
    while stream.pending or stream.inflight:
        dispatched = stream.inflight < stream.depth and stream.dispatch(1e9, flush=True)
        if stream.inflight and (not dispatched or stream.inflight >= stream.depth):
            for t, answer, err in stream.collect():
                done[t] = (answer, err)
    return done


def _shared_spy(scorer):
    """Records the member ids of every prefix group the stream prefills (the real call runs)."""
    seen, real = [], scorer.dispatch_shared

    def spy(mode, groups):
        seen.append([[it.rendered.id for it in g.items] for g in groups])
        return real(mode, groups)
    return seen, spy


# "score" decodes every request alone as the reference (~2.5 min on 2 cores): slow; the HTTP
# tests (test_serve.py) run full scoring through the stream in the default suite.
@pytest.mark.parametrize("mode", ["p_pass", pytest.param("full", marks=pytest.mark.slow)])
def test_stream_rows_equal_each_request_alone_in_order_groups_shared(scorer, requests, mode, monkeypatch, request):
    from rm_jax.serve.stream import ScoreStream
    alone = (request.getfixturevalue("alone_p_pass") if mode == "p_pass" else [scorer.score(r) for r in requests])
    batches = []
    stream = ScoreStream(scorer, lambda kind, samples, results: list(results), max_wait_s=0.0,
                         on_batch=lambda kind, n: batches.append(n))
    seen, spy = _shared_spy(scorer)
    monkeypatch.setattr(scorer, "dispatch_shared", spy)
    done = _drain(stream, [(i, mode, r) for i, r in enumerate(requests)])

    assert sorted(done) == list(range(len(requests)))
    for i, r in enumerate(requests):
        answer, err = done[i]
        assert err is None
        assert [x.id for x in answer] == [s.id for s in r]                 # order kept
        for got, ref in zip(answer, alone[i]):
            assert (got.error is None) == (ref.error is None), (got, ref)
            if ref.error is not None:
                assert got.error == ref.error
                continue
            np.testing.assert_allclose(got.p_pass, ref.p_pass, atol=1e-5)
            np.testing.assert_allclose(got.off_vocab_mass, ref.off_vocab_mass, atol=1e-5)
            if mode == "full":
                assert got.text == ref.text and got.verdict == ref.verdict
    # device batches of at most BATCH rows, fuller than one call per request could make them
    assert max(batches) <= BATCH and len(batches) < sum(-(-len(r) // BATCH) for r in requests)
    # a GRPO group split over two requests (p*-s0 in one, its siblings in the next) was prefilled
    # once, whole
    split = {a[-1].prompt_id for a, b in zip(requests, requests[1:]) if a[-1].prompt_id == b[0].prompt_id}
    prefilled = {tuple(sorted(ids)) for step in seen for ids in step}
    failed = {s.id for r, rows in zip(requests, alone) for s, row in zip(r, rows) if row.error is not None}
    whole = {tuple(sorted(s.id for r in requests for s in r if s.prompt_id == p and s.id not in failed)) for p in split}
    assert split and whole & prefilled, (whole, prefilled)


@pytest.mark.slow   # ~12 s on 2 cores (parts=1: its own step shapes)
def test_spare_member_rows_take_lone_items_and_split_groups(scorer, requests, alone_p_pass, monkeypatch):
    """One device batch of members per step (``parts=1``): a group of 3 leaves a spare row, which
    a lone item (a one-member group) or a member split off another group takes; the rows still
    equal each request scored alone."""
    from rm_jax.serve.stream import ScoreStream
    alone = alone_p_pass
    stream = ScoreStream(scorer, lambda kind, samples, results: list(results), max_wait_s=0.0,
                         parts=1)
    seen, spy = _shared_spy(scorer)
    monkeypatch.setattr(scorer, "dispatch_shared", spy)
    done = _drain(stream, [(i, ScoreMode.P_PASS, r) for i, r in enumerate(requests)])
    for i in range(len(requests)):
        answer, err = done[i]
        assert err is None
        np.testing.assert_allclose([x.p_pass for x in answer], [x.p_pass for x in alone[i]], atol=1e-5)
    scored = [s for r, rows in zip(requests, alone) for s, row in zip(r, rows) if row.error is None]
    size = {p: sum(s.prompt_id == p for s in scored) for p in {s.prompt_id for s in scored}}
    by_id = {s.id: s.prompt_id for s in scored}
    filled = [step for step in seen
              if sum(map(len, step)) == BATCH and any(len(ids) < size[by_id[ids[0]]] for ids in step)]
    assert filled, seen


@pytest.mark.slow   # ~2 min on 2 cores; the server's drain and 503 paths run in test_serve.py
def test_batcher_with_stream_answers_concurrent_jobs_and_drains(scorer, requests):
    """The worker thread over the stream: concurrent submits each get their own rows; stop()
    answers every admitted job first."""
    from rm_jax.serve.batcher import Batcher
    from rm_jax.serve.stream import ScoreStream
    alone = [scorer.p_pass(r) for r in requests]
    stream = ScoreStream(scorer, lambda kind, samples, results: [x.p_pass for x in results],
                         max_wait_s=0.005)
    never = lambda kind, payloads: (_ for _ in ()).throw(AssertionError("the stream scores these"))
    batcher = Batcher(never, max_batch=BATCH, max_wait_s=0.005, max_queue=1024, stream=stream)
    batcher.start()
    assert batcher.worker_alive

    async def go():
        return await asyncio.gather(*(batcher.submit(ScoreMode.P_PASS, r, len(r)) for r in requests))
    got = asyncio.run(go())
    for answer, ref in zip(got, alone):
        np.testing.assert_allclose(answer, [x.p_pass for x in ref], atol=1e-5)
    assert batcher.depth == 0
    # a job admitted just before stop() is answered, then the worker ends
    loop = asyncio.new_event_loop()
    fut = loop.run_until_complete(_submit_then_stop(batcher, requests[1]))
    loop.close()
    np.testing.assert_allclose(fut, [x.p_pass for x in alone[1]], atol=1e-5)
    assert not batcher.worker_alive


async def _submit_then_stop(batcher, samples):
    task = asyncio.ensure_future(batcher.submit(ScoreMode.P_PASS, samples, len(samples)))
    await asyncio.sleep(0)                  # submitted (admitted to the queue)
    stopper = threading.Thread(target=batcher.stop)
    stopper.start()
    out = await task
    stopper.join()
    return out
