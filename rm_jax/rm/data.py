"""Built pair splits as flat arrays (evaluation, scoring) and the static-shaped microbatch arrays
the RM step takes.

A microbatch holds whole prompt groups: ``rows`` candidate sequences (each candidate once, however
many pairs it is in) and ``pairs`` pair slots indexing those rows, so chosen and rejected go
through one forward and a prompt's pairs never straddle microbatches. Shapes are fixed per run
(rows, pairs, length, image budget), so the step compiles once. Padding rows have an all-zero
mask; padding pairs weight 0. Training draws its microbatches from the Grain loader
(rm_jax.rm.pair_loader); this module's flat split serves evaluation.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from rm_jax.model import JudgeInputs, prepare_inputs
from rm_jax.rm import pair_records


@dataclasses.dataclass
class PairSplit:
    """One split as built (rm_jax.rm.build)."""
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_len: np.ndarray
    response_len: np.ndarray
    pixels: np.ndarray
    pix_offsets: np.ndarray
    grids: np.ndarray
    grid_offsets: np.ndarray
    group: np.ndarray          # [C] group index of each candidate
    utility: np.ndarray        # [C] (nan when not given)
    pair_a: np.ndarray
    pair_b: np.ndarray
    pair_p: np.ndarray
    pair_w: np.ndarray
    pair_m: np.ndarray
    pair_group: np.ndarray
    groups: list[dict]

    @property
    def n_candidates(self) -> int:
        return len(self.group)

    def length(self, c: int) -> int:
        return int(self.offsets[c + 1] - self.offsets[c])

    def ids(self, c: int) -> np.ndarray:
        return self.tokens[self.offsets[c]:self.offsets[c + 1]]

    def group_candidates(self) -> list[np.ndarray]:
        order = np.argsort(self.group, kind="stable")
        cuts = np.flatnonzero(np.diff(self.group[order])) + 1
        return np.split(order, cuts) if len(order) else []


def load_split(data_dir: str, split: str) -> PairSplit:
    """A whole split from its group records, as flat arrays (evaluation: small splits)."""
    groups = pair_records.read_split(data_dir, split)
    return split_from_groups(groups)


def split_from_groups(groups: list[dict]) -> PairSplit:
    cat = lambda key, dtype, shape=(0,): (np.concatenate([g[key] for g in groups]).astype(dtype) if groups
                                         else np.zeros(shape, dtype))
    offsets = lambda key: np.concatenate([[0]] + [g[key][1:] + base for g, base in
                                                  zip(groups, np.cumsum([0] + [g[key][-1] for g in groups])[:-1])]
                                         ).astype(np.int64)
    n_cand = [len(g["prompt_len"]) for g in groups]
    cand_base = np.cumsum([0] + n_cand)[:-1]
    pdim = next((g["pixels"].shape[1] for g in groups if g["pixels"].size), 1)
    return PairSplit(
        tokens=cat("tokens", np.int32), offsets=offsets("offsets"), prompt_len=cat("prompt_len", np.int32),
        response_len=cat("response_len", np.int32),
        pixels=(np.concatenate([g["pixels"].reshape(-1, pdim) for g in groups]) if groups
                else np.zeros((0, pdim), np.float16)),
        pix_offsets=offsets("pix_offsets"),
        grids=np.concatenate([g["grids"].reshape(-1, 3) for g in groups]).astype(np.int32) if groups
        else np.zeros((0, 3), np.int32),
        grid_offsets=offsets("grid_offsets"),
        group=np.repeat(np.arange(len(groups)), n_cand).astype(np.int32), utility=cat("utility", np.float64),
        pair_a=np.concatenate([g["pair_a"] + base for g, base in zip(groups, cand_base)]).astype(np.int32)
        if groups else np.zeros(0, np.int32),
        pair_b=np.concatenate([g["pair_b"] + base for g, base in zip(groups, cand_base)]).astype(np.int32)
        if groups else np.zeros(0, np.int32),
        pair_p=cat("pair_p", np.float32), pair_w=cat("pair_w", np.float32), pair_m=cat("pair_m", np.float32),
        pair_group=np.repeat(np.arange(len(groups)), [len(g["pair_a"]) for g in groups]).astype(np.int32),
        groups=[{"id": g["id"], "prompt_id": g["prompt_id"], "slice": g["slice"], "candidates": list(g["candidates"]),
                 "utilities": [None if np.isnan(u) else float(u) for u in g["utility"]],
                 "sources": list(g["sources"])} for g in groups])


@flax.struct.dataclass
class RMBatch:
    """Leaves with a leading [A] (accumulation) axis."""
    inputs: JudgeInputs
    response_mask: jax.Array   # [A, C, T]
    pair_a: jax.Array          # [A, P] rows of the same microbatch
    pair_b: jax.Array
    pair_p: jax.Array
    pair_m: jax.Array
    pair_w: jax.Array          # effective weights (rm_jax.rm.loss.effective_weights); 0 = padding


@dataclasses.dataclass(frozen=True)
class BatchShape:
    rows: int
    pairs: int
    length: int
    max_patches: int
    max_images: int
    frame_capacity: int


@dataclasses.dataclass
class Micro:
    """Host view of one microbatch (numpy), before stacking."""
    candidates: np.ndarray     # split candidate index per row
    pairs: np.ndarray          # split pair index per pair slot


def empty_pair_slots(n: int) -> dict[str, np.ndarray]:
    """``n`` pair slots of a microbatch, every one off (``pair_valid`` False, weight 0)."""
    return {"pair_a": np.zeros(n, np.int32), "pair_b": np.zeros(n, np.int32),
            "pair_p": np.full(n, 0.5, np.float32), "pair_m": np.zeros(n, np.float32),
            "pair_w_raw": np.zeros(n, np.float32), "pair_group": np.full(n, -1, np.int64),
            "pair_valid": np.zeros(n, bool)}


def padded_images(pixels: list[np.ndarray], grids: list[np.ndarray], patch_dim: int, max_patches: int,
                  max_images: int) -> tuple[np.ndarray, np.ndarray]:
    """A microbatch's patches [max_patches, patch_dim] and grids [max_images, 3], zero-padded to the
    run's static image budget; a microbatch over it is an error."""
    pix_cat = np.concatenate(pixels) if pixels else np.zeros((0, patch_dim), np.float32)
    grid_cat = np.concatenate(grids) if grids else np.zeros((0, 3), np.int32)
    if len(pix_cat) > max_patches or len(grid_cat) > max_images:
        raise ValueError(f"a microbatch holds {len(pix_cat)} patches / {len(grid_cat)} images, over "
                         f"rm.max_patches={max_patches} / rm.max_images={max_images}")
    pix_pad = np.zeros((max_patches, patch_dim), np.float32)
    pix_pad[:len(pix_cat)] = pix_cat
    grid_pad = np.zeros((max_images, 3), np.int32)
    grid_pad[:len(grid_cat)] = grid_cat
    return pix_pad, grid_pad


def micro_arrays(split: PairSplit, micro: Micro, shape: BatchShape, mcfg, pad_id: int) -> dict:
    """Numpy arrays of one microbatch (right padding)."""
    c_rows, t = shape.rows, shape.length
    ids = np.full((c_rows, t), pad_id, np.int32)
    mask = np.zeros((c_rows, t), np.int32)
    resp = np.zeros((c_rows, t), np.int32)
    pix, grid = [], []
    row_of = {}
    for r, c in enumerate(micro.candidates):
        seq = split.ids(c)
        if len(seq) > t:
            raise ValueError(f"candidate of length {len(seq)} over the run length {t}")
        ids[r, :len(seq)] = seq
        mask[r, :len(seq)] = 1
        resp[r, split.prompt_len[c]:len(seq)] = 1
        pix.append(split.pixels[split.pix_offsets[c]:split.pix_offsets[c + 1]])
        grid.append(split.grids[split.grid_offsets[c]:split.grid_offsets[c + 1]])
        row_of[int(c)] = r
    v = mcfg.vision
    pdim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2   # the vision tower's patch width
    pix = [x.reshape(-1, pdim) for x in pix]                            # (a text-only split stores width 1)
    pix_pad, grid_pad = padded_images(pix, grid, pdim, shape.max_patches, shape.max_images)
    inputs = prepare_inputs(mcfg, ids, mask, pix_pad, grid_pad, attention="lengths",
                            frame_capacity=shape.frame_capacity)
    inputs = inputs.replace(kv_lengths_b=np.maximum(inputs.kv_lengths_b, 1))
    out = {"inputs": inputs, "response_mask": resp, **empty_pair_slots(shape.pairs)}
    for k, q in enumerate(micro.pairs):
        out["pair_a"][k] = row_of[int(split.pair_a[q])]
        out["pair_b"][k] = row_of[int(split.pair_b[q])]
        out["pair_p"][k], out["pair_m"][k] = split.pair_p[q], split.pair_m[q]
        out["pair_w_raw"][k], out["pair_group"][k] = split.pair_w[q], split.pair_group[q]
        out["pair_valid"][k] = True
    return out


def assemble(micros: list[dict], group_normalize: bool) -> RMBatch:
    """Stack a step's microbatches; the effective weights are computed over the whole step."""
    from rm_jax.rm.loss import effective_weights
    w = effective_weights(np.concatenate([m["pair_w_raw"] for m in micros]),
                          np.concatenate([m["pair_group"] for m in micros]),
                          np.concatenate([m["pair_valid"] for m in micros]), group_normalize)
    stack = lambda key: np.stack([m[key] for m in micros])
    return RMBatch(inputs=jax.tree.map(lambda *xs: np.stack(xs), *[m["inputs"] for m in micros]),
                   response_mask=stack("response_mask"), pair_a=stack("pair_a"), pair_b=stack("pair_b"),
                   pair_p=stack("pair_p"), pair_m=stack("pair_m"), pair_w=w.reshape(len(micros), -1))


def non_pad_tokens(batch: RMBatch) -> int:
    return int(np.sum(batch.inputs.attention_mask_bt))


def split_from_rendered(rendered: list) -> PairSplit:
    """Candidates rendered on the fly (benchmarks, scoring files) as a pair-less split."""
    lens = lambda xs: np.cumsum([0] + [len(x) for x in xs]).astype(np.int64)
    toks = [np.concatenate([c.prompt_ids, c.response_ids]) for c in rendered]
    pix = [c.pixel_values for c in rendered]
    pdim = next((p.shape[1] for p in pix if p.size), 1)
    z = np.zeros(0, np.int32)
    return PairSplit(tokens=np.concatenate(toks).astype(np.int32) if toks else z, offsets=lens(toks),
                     prompt_len=np.asarray([len(c.prompt_ids) for c in rendered], np.int32),
                     response_len=np.asarray([len(c.response_ids) for c in rendered], np.int32),
                     pixels=np.concatenate([p.reshape(-1, pdim) for p in pix]) if pix else np.zeros((0, pdim)),
                     pix_offsets=lens(pix),
                     grids=np.concatenate([c.image_grid_thw for c in rendered]) if rendered else np.zeros((0, 3), np.int32),
                     grid_offsets=lens([c.image_grid_thw for c in rendered]),
                     group=np.arange(len(rendered), dtype=np.int32), utility=np.full(len(rendered), np.nan),
                     pair_a=z, pair_b=z, pair_p=z.astype(np.float32), pair_w=z.astype(np.float32),
                     pair_m=z.astype(np.float32), pair_group=z, groups=[{} for _ in rendered])


def score_candidates(builder, params, split: PairSplit, shape: BatchShape, mcfg, pad_id: int) -> np.ndarray:
    """Reward of every candidate of a split, [C] (rows packed in order, one microbatch at a time)."""
    out = np.full(split.n_candidates, np.nan, np.float64)
    idx = np.arange(split.n_candidates)
    for start in range(0, len(idx), shape.rows):
        rows = idx[start:start + shape.rows]
        # Images are packed per microbatch; split further when a chunk is over the image budget.
        chunks = [rows]
        while True:
            bad = [c for c in chunks if _patches(split, c) > shape.max_patches and len(c) > 1]
            if not bad:
                break
            c = bad[0]
            k = chunks.index(c)
            chunks[k:k + 1] = [c[:len(c) // 2], c[len(c) // 2:]]
        for c in chunks:
            m = micro_arrays(split, Micro(c, np.zeros(0, np.int64)), shape, mcfg, pad_id)
            batch = assemble([m], True)
            out[c] = builder.score(params, batch)[0, :len(c)]
    return out


def _patches(split: PairSplit, rows) -> int:
    return int(sum(split.pix_offsets[c + 1] - split.pix_offsets[c] for c in rows))
