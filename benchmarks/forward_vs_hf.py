"""Forward throughput: rm_jax (jitted) vs transformers + PyTorch, same tiny config, batch and CPU.

    python -m benchmarks.forward_vs_hf [--batch=4 --seq=256 --iters=5]

Prints tokens/s of each and the ratio, then the MoE layer's achieved FLOP rate as a fraction of a
dense matmul with the same FLOPs (how much the dropless sort + grouped matmul costs over ideal),
for the default grouped matmul (``ragged_dot="auto"``: tiled on CPU) and for XLA's ragged_dot
through tokamax.
The last line is one JSON object. A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import json
import tempfile

from absl import app, flags
from benchmarks.timing import median_seconds  # noqa: E402
from rm_jax.model.config import hf_config_dict  # noqa: E402

flags.DEFINE_integer("batch", 4, "sequences per forward")
flags.DEFINE_integer("seq", 256, "tokens per sequence")
flags.DEFINE_integer("iters", 9, "timed iterations (after one warm-up)")
flags.DEFINE_integer("images", 1, "images per batch (8x12-patch each, in row 0..)")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from configs.tiny import hf_model_config
    from rm_jax.model import load_hf
    from rm_jax.model.moe import MoeConfig, SparseMoeBlock, resolve_ragged_dot, tile_sizes

    f = flags.FLAGS
    hf_dict = hf_config_dict(hf_model_config().to_dict())
    torch.manual_seed(0)
    hf = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**hf_dict)).eval()
    tmp = tempfile.mkdtemp()
    hf.save_pretrained(tmp)
    model, cfg = load_hf(tmp)

    rng = np.random.default_rng(0)
    b, t = f.batch, f.seq
    ids = rng.integers(20, cfg.text.vocab_size, (b, t))
    grids = np.array([[1, 8, 12]] * f.images).reshape(-1, 3)
    n_img = 8 * 12 // cfg.vision.spatial_merge_size ** 2
    for row in range(f.images):
        ids[row, 10], ids[row, 11:11 + n_img], ids[row, 11 + n_img] = (
            cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
    mask = np.ones_like(ids)
    pixels = rng.standard_normal((int(np.prod(grids, -1).sum()), cfg.vision.patch_dim)).astype(np.float32)
    kw = dict(attention_mask=mask) if not f.images else dict(attention_mask=mask, pixel_values=pixels,
                                                               image_grid_thw=grids)

    jax_s = median_seconds(lambda: model(ids, **kw).block_until_ready(), f.iters)
    tkw = {k: torch.tensor(v) for k, v in kw.items()}
    if f.images:
        tkw["mm_token_type_ids"] = torch.tensor((ids == cfg.image_token_id).astype(np.int64))
    with torch.no_grad():
        hf_s = median_seconds(lambda: hf(input_ids=torch.tensor(ids), **tkw), f.iters)
    tokens = b * t
    print(f"{'impl':<14}{'s/forward':>12}{'tokens/s':>14}")
    print(f"{'rm_jax':<14}{jax_s:>12.4f}{tokens / jax_s:>14.0f}")
    print(f"{'transformers':<14}{hf_s:>12.4f}{tokens / hf_s:>14.0f}")
    print(f"speedup rm_jax / transformers: {hf_s / jax_s:.2f}x")

    # MoE layer vs a dense matmul of equal FLOPs (router + 3 expert matmuls per routed token).
    tc = cfg.text
    x = jnp.asarray(rng.standard_normal((b, t, tc.hidden_size)), jnp.float32)
    n_out = tc.num_experts + 3 * tc.num_experts_per_tok * tc.moe_intermediate_size
    flops = 2 * tokens * tc.hidden_size * n_out
    w = jnp.asarray(rng.standard_normal((tc.hidden_size, n_out)), jnp.float32)
    dense_fn = jax.jit(lambda x, w: x.reshape(-1, x.shape[-1]) @ w)
    dense_s = median_seconds(lambda: dense_fn(x, w).block_until_ready(), max(f.iters, 20))
    frac = {}
    for impl in ("auto", "tokamax"):
        moe = SparseMoeBlock(MoeConfig(tc.hidden_size, tc.moe_intermediate_size, tc.num_experts,
                                       tc.num_experts_per_tok, ragged_dot=impl), rngs=nnx.Rngs(0))
        gdef, state = nnx.split(moe)
        moe_fn = jax.jit(lambda s, x: nnx.merge(gdef, s)(x)[0])
        moe_s = median_seconds(lambda: moe_fn(state, x).block_until_ready(), max(f.iters, 20))
        frac[impl] = dense_s / moe_s
        print(f"MoE layer ({impl}={resolve_ragged_dot(impl)}): {moe_s * 1e3:.3f} ms, "
              f"{flops / moe_s / 1e9:.2f} GFLOP/s; dense matmul same FLOPs: {dense_s * 1e3:.3f} ms, "
              f"{flops / dense_s / 1e9:.2f} GFLOP/s; fraction {frac[impl]:.3f}")
    print(json.dumps({"bench": "forward_vs_hf", "speedup_vs_hf": round(hf_s / jax_s, 3),
                      "moe_flop_fraction": round(frac["auto"], 3),
                      "moe_flop_fraction_tokamax": round(frac["tokamax"], 3),
                      "moe_impl": resolve_ragged_dot("auto"),
                      "tile_rows": list(tile_sizes(tokens * tc.num_experts_per_tok, tc.num_experts)),
                      "rm_jax_s": round(jax_s, 5), "hf_s": round(hf_s, 5),
                      "rm_jax_tokens_per_s": round(tokens / jax_s, 1),
                      "hf_tokens_per_s": round(tokens / hf_s, 1), "batch": b, "seq": t, "images": f.images,
                      "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    app.run(main)
