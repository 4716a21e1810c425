"""The synthetic set's tokenizer directory: byte-level BPE, a Qwen3-VL-style chat template, and a
Qwen2-VL image processor, all loadable with transformers' Auto classes.

Design choices
--------------
* **Byte-level BPE trained offline** with the `tokenizers` library on the synthetic corpus (message
  texts, tool schemas, judge contracts, verdict JSON). A real Qwen vocabulary (150k+) would make
  the tiny model's embedding table dominate its parameters; 4096 entries cover this corpus well
  and keep the judge input short.
* **Special tokens first.** configs.tiny.SPECIAL_TOKENS are the trainer's special tokens, so they
  get ids 0..10 in that order; the model config hard-codes image/vision ids from that order.
  We assert it rather than trust it.
* **GPT-2-style pre-tokenization**, not Qwen's regex: Qwen's lets a quote join the following
  letters (``"pass``), which would put the verdict word in a different token depending on its
  left context. Here ``{"l3": "`` ends in its own ``": "`` piece and ``pass``/``fail`` are whole
  tokens in and out of context, so the verdict slot is one clean token (asserted). Runs of
  punctuation with single inner spaces (``", "``) are one piece, which shortens JSON a lot.
* **Chat template modelled on Qwen3-VL's**: tools listed in the system turn inside
  ``<tools></tools>``; content as a string or parts; one ``<|vision_start|><|image_pad|><|vision_end|>``
  per image (the renderer expands the pad to the image's merged-token count); assistant tool
  calls as ``<tool_call>\\n{json}\\n</tool_call>``; consecutive ``role=tool`` messages wrapped in
  ``<tool_response>`` inside one user turn; ``add_generation_prompt`` opens an assistant turn.
  The template's fixed strings are added to the BPE corpus so they cost few tokens.
* **Image processor**: Qwen2VLImageProcessor with patch 8 / temporal 2 / merge 2 and the pixel
  budget from configs.tiny get_config().data.image. Without torchvision transformers builds the PIL
  backend; that is the intended run-time path (no torch at run time).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken

from configs import tiny

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen's tool preamble, shortened: the tiny judge's text budget is ~600 tokens.
TOOLS_HEADER = "# Tools\n\nFunction signatures within <tools></tools>:\n<tools>"
TOOLS_FOOTER = ("\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")

# GPT-2's split, except that (1) a run of punctuation may contain single spaces: JSON glue such as
# `", "`, `": "` or `"}, {"` becomes one piece (JSON is most of the judge input), while letters
# and digits stay separate pieces, so `pass`/`fail` and values like `2K` are never glued to quotes;
# (2) letters and digits never take the space before them: a value is the same token in a request
# (` red`, ` 2K`) and in a call's JSON (`"red"`, `"2K"`), so comparing them is token identity;
# (3) a ratio (`16:9`) and a number with a one-letter unit (`2K`) are one piece: otherwise `16:9`
# and `9:16` are the same tokens in another order, and `2K` shares its digit with a count of 2.
PRETOKENIZE_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d|\p{N}+:\p{N}+|\p{N}+\p{Lu}(?!\p{L})|\p{L}+|\p{N}+"
                     r"| ?[^\s\p{L}\p{N}]+(?: [^\s\p{L}\p{N}]+)*"
                     r"|\s+(?!\S)|\s+")

# Jinja: modelled on Qwen3-VL's template (same structure and markers), minus video and thinking.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is none -%}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- render_content(messages[0].content) -}}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- " + json.dumps(TOOLS_HEADER) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- " + json.dumps(TOOLS_FOOTER) + " -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' -}}{{- render_content(messages[0].content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}{{- render_content(message.content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{{- render_content(message.content) -}}"
    "{%- if message.tool_calls -%}{%- for tool_call in message.tool_calls -%}"
    "{%- if (loop.first and message.content) or (not loop.first) -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' -}}{{- tool_call.name -}}{{- '\", \"arguments\": ' -}}"
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- render_content(message.content) -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Fixed strings the template emits: part of the BPE corpus so they compress.
# Fixed strings the template (and the judge renderer's transcript) emit in every sample: repeated
# in the BPE corpus with a weight so they compress like the text around them.
TEMPLATE_TEXTS = (TOOLS_HEADER, TOOLS_FOOTER, "<tool_call>\n{\"name\": \"", "\", \"arguments\": ",
                  "\n<tool_response>\n", "\n</tool_response>", "## Conversation\n", "## Response to judge\n",
                  "[assistant]\n", "[user]\n", "[system]\n", "[tool: generate_image]\n", "[tool: unknown]\n",
                  "status: ok, images: [{image: ", ", width: ", ", height: ", "}]\n")
TEMPLATE_WEIGHT = 64
# Added tokens that are not special (skip_special_tokens keeps them), as in Qwen's tokenizers.
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>")


def train_bpe(corpus_texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]):
    """A byte-level BPE `tokenizers.Tokenizer` whose first ids are `special_tokens` in order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus_texts), trainer=trainer)
    return tok


def write_image_processor(out_dir: str, image_cfg=None) -> None:
    """Qwen2-VL image processor with the tiny model's patching and the policy's pixel budget."""
    import transformers

    image_cfg = image_cfg if image_cfg is not None else tiny.get_config().data.image
    vcfg = tiny.hf_model_config().vision_config
    proc = transformers.Qwen2VLImageProcessor(
        patch_size=int(vcfg.patch_size), temporal_patch_size=int(vcfg.temporal_patch_size),
        merge_size=int(vcfg.spatial_merge_size),
        min_pixels=int(image_cfg.min_pixels), max_pixels=int(image_cfg.max_pixels))
    proc.save_pretrained(out_dir)


def write_tokenizer_dir(out_dir: str, corpus_texts: Iterable[str], vocab_size: int = 4096) -> None:
    """Trains the tokenizer on `corpus_texts` and writes tokenizer + chat template + image
    processor to `out_dir` (loadable with AutoTokenizer / AutoImageProcessor.from_pretrained)."""
    import transformers

    max_vocab = int(tiny.hf_model_config().text_config.vocab_size)
    if vocab_size > max_vocab:
        raise ValueError(f"vocab_size {vocab_size} exceeds the tiny model's vocab_size {max_vocab}")
    specials = list(tiny.SPECIAL_TOKENS)
    texts = list(corpus_texts) + list(TEMPLATE_TEXTS) * TEMPLATE_WEIGHT + ['{"l3": "pass"', '{"l3": "fail"', "pass", "fail"]
    raw = train_bpe(texts, vocab_size, specials)
    for i, t in enumerate(specials):
        got = raw.token_to_id(t)
        if got != i:
            raise AssertionError(f"special token {t!r} has id {got}, expected {i}")

    # Qwen's tokenizers add the tool-call tags as plain (non-special) added tokens: clients that
    # decode with skip_special_tokens=True (TRL, verl) must still see a policy's calls. Same ids.
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in specials if t not in (EOS_TOKEN, PAD_TOKEN, *PLAIN_ADDED_TOKENS)],
        clean_up_tokenization_spaces=False, model_max_length=8192)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    write_image_processor(out_dir)

    # Check what a consumer will load, not the object in memory.
    loaded = transformers.AutoTokenizer.from_pretrained(out_dir)
    for i, t in enumerate(specials):
        if loaded.convert_tokens_to_ids(t) != i:
            raise AssertionError(f"reloaded tokenizer: {t!r} is not id {i}")
    for t in PLAIN_ADDED_TOKENS:
        if t in loaded.all_special_tokens:
            raise AssertionError(f"reloaded tokenizer: {t!r} is special; Qwen's tokenizers add it as a plain token")
    if len(loaded) > max_vocab:
        raise AssertionError(f"tokenizer has {len(loaded)} entries > {max_vocab}")
    p = loaded("pass", add_special_tokens=False)["input_ids"]
    f = loaded("fail", add_special_tokens=False)["input_ids"]
    if not p or not f or p[0] == f[0]:
        raise AssertionError(f"'pass' and 'fail' must start with distinct tokens: {p} vs {f}")


# What write_tokenizer_dir writes (save_pretrained and the image processor); an HF checkpoint
# dir exported by launch.convert holds the same files beside its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "special_tokens_map.json")
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


def copy_tokenizer_dir(src_dir: str, out_dir: str) -> None:
    """Copies an existing tokenizer (a tokenizer dir, or an HF checkpoint dir) instead of training
    one: data generated for a pretrained base must be read with the base's own ids."""
    missing = [f for f in REQUIRED_TOKENIZER_FILES if not os.path.isfile(os.path.join(src_dir, f))]
    if missing:
        raise FileNotFoundError(f"{src_dir}: no tokenizer here (missing {', '.join(missing)})")
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(out_dir, name))
