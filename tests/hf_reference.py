"""The transformers reference for Qwen3-VL-MoE parity tests: a lopsided tiny config, a random-weight
``Qwen3VLMoeForConditionalGeneration`` saved as a checkpoint, a two-image batch with right padding,
and the reference forward (logits, every decoder layer's output, the vision features).

The config is deliberately lopsided so layout bugs cannot cancel out: H != 2I, one KV head
(GQA 4:1), 7 experts with top-3, a dense layer among sparse ones, two deepstack levels, two
non-square images of different sizes in different batch rows, right padding, and >= 600 tokens
(short prompts hide RoPE bugs).
"""

import numpy as np
import torch

IMAGE, VSTART, VEND = 5, 3, 4


def parity_hf_config(**text_overrides):
    text = dict(vocab_size=512, hidden_size=48, intermediate_size=80, moe_intermediate_size=20,
                num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                num_experts=7, num_experts_per_tok=3, decoder_sparse_step=1, mlp_only_layers=[2],
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                     mrope_interleaved=True))
    text.update(text_overrides)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
                  num_position_embeddings=36, deepstack_visual_indexes=[0, 2])
    return dict(model_type="qwen3_vl_moe", image_token_id=IMAGE, video_token_id=6,
                vision_start_token_id=VSTART, vision_end_token_id=VEND,
                tie_word_embeddings=text["tie_word_embeddings"], text_config=text, vision_config=vision)


def build_hf(cfg_dict, path, seed=0):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**cfg_dict)).eval().float()
    # HF initializes norms to 1 and biases to 0; randomize them so their mapping is tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def multimodal_batch(seed=0, t=640):
    """Two rows; row 0 holds a 12x8-patch image, row 1 a 10x16-patch image and right padding."""
    rng = np.random.default_rng(seed)
    grids = np.array([[1, 12, 8], [1, 10, 16]])
    ids = rng.integers(10, 512, (2, t))
    starts = (t // 6, t // 2)
    for row, ((_, h, w), s) in enumerate(zip(grids, starts)):
        n = h * w // 4
        ids[row, s - 1], ids[row, s:s + n], ids[row, s + n] = VSTART, IMAGE, VEND
    mask = np.ones_like(ids)
    mask[1, t - 37:] = 0
    n_patches = int(np.prod(grids, -1).sum())
    pixels = rng.standard_normal((n_patches, 3 * 2 * 4 * 4)).astype(np.float32)
    return ids, mask, pixels, grids


def hf_forward(model, ids, mask, pixels=None, grids=None):
    """Logits, each decoder layer's output (forward hooks), and the vision features."""
    layer_out = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: layer_out.append(out.detach().numpy()))
             for layer in model.model.language_model.layers]
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if pixels is not None:
        kw.update(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)))
    try:
        with torch.no_grad():
            logits = model(**kw).logits.numpy()
            vis = None
            if pixels is not None:
                v = model.model.get_image_features(torch.tensor(pixels), torch.tensor(grids))
                vis = (torch.cat(v.pooler_output).numpy(),
                       [torch.cat(f).numpy() for f in v.deepstack_features])
    finally:
        for h in hooks:
            h.remove()
    return logits, np.stack(layer_out), vis


def rel_err(ours, ref):
    return float(np.max(np.abs(np.asarray(ours) - ref)) / max(1.0, float(np.max(np.abs(ref)))))
