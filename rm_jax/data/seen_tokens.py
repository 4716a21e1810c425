"""Seen-token labels: a dense, self-supervised signal for the comparison every verdict needs.

Every failure the judge must find is a value in the response that disagrees with the request, a
tool result or an image, and on the text side the primitive under all of them is *presence*: does
this token of the response occur in the conversation before it? A small judge trained from the
verdict alone gets one bit per sample for that, and forms the lookup late or not at all
(docs/experiments/, issue 16). This labels every token of the judged response, in every example, with
that primitive: 1 where the token does not occur in the input before the response, 0 where it
does. The labels come from the input ids alone (no teacher, no swap), so real data has them too.

The term reads the verdict tokens' logits (``fail`` against ``pass``) at each labelled position,
like the swapped-value term (rm_jax.data.value_swap), so it adds no parameters and the checkpoint
exports unchanged.
"""

from __future__ import annotations

import numpy as np

from rm_jax.data.value_swap import VALUE_KEPT, VALUE_OFF, VALUE_SWAPPED

SEEN = VALUE_KEPT        # the token occurs before the response
UNSEEN = VALUE_SWAPPED   # it does not


def seen_targets(batch: dict, max_positions: int, skip_ids: np.ndarray | None = None,
                 only_ids: np.ndarray | None = None, cumulative: bool = False) -> np.ndarray:
    """[B, T] int8 labels for the first ``max_positions`` response tokens of each valid row
    (VALUE_OFF elsewhere). ``batch``: loader arrays (input_ids, example_valid, response_start,
    response_end). ``skip_ids``: token ids never labelled (e.g. special tokens); ``only_ids``: when
    given, only these are labelled (the value classes: a call's markup is new in every first call,
    pass or fail, and would teach the verdict readout nothing).

    ``cumulative``: also every other position from the response's start up to the one before the
    verdict slot's is labelled with "an unseen token has occurred in the response so far" (the
    running OR of the labels above). The readout a verdict needs (is any value of the response
    new?) then has a label at every position, and the slot's own input, one position before it,
    carries the answer (batch needs ``verdict_pos``)."""
    ids = np.asarray(batch["input_ids"])
    b, t = ids.shape
    out = np.full((b, t), VALUE_OFF, np.int8)
    for i in range(b):
        lo, hi = int(batch["response_start"][i]), int(batch["response_end"][i])
        if not batch["example_valid"][i] or lo < 0 or hi <= lo:
            continue
        span = ids[i, lo:hi]
        keep = np.ones(len(span), bool) if skip_ids is None else ~np.isin(span, skip_ids)
        if only_ids is not None:
            keep &= np.isin(span, only_ids)
        if not cumulative:
            where = np.flatnonzero(keep)[:max_positions]
            before = np.isin(span[where], ids[i, :lo])
            out[i, lo + where] = np.where(before, SEEN, UNSEEN)
            continue
        # The verdict is read at verdict_pos - 1 (its logits predict the verdict token): not labelled.
        stop = int(batch["verdict_pos"][i]) - 1
        if stop <= lo:
            continue
        new_t = np.zeros(stop - lo, bool)
        new_t[:hi - lo] = keep & ~np.isin(span, ids[i, :lo])
        running = np.logical_or.accumulate(new_t)
        running[hi - lo:] = running[hi - lo - 1]
        labels = np.where(running, UNSEEN, SEEN)
        own = np.flatnonzero(keep)                # a labelled token keeps its own label
        labels[own] = np.where(new_t[own], UNSEEN, SEEN)
        first = max(lo, stop - max_positions)     # the positions nearest the slot matter most
        out[i, first:stop] = labels[first - lo:]
    return out
