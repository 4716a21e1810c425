"""Judge contract texts (the system prompt of the judge), routed by the judged response.

The tool-call contract applies when the judged response calls tools; the text-only contract
applies otherwise. The text-only contract exists because the field report's first teacher,
given only the tool-call contract, invented tool calls for text answers in order to fill the
contract's format, and judged them. Its first hard rule forbids exactly that.
"""

OUTPUT_FORMAT = (
    'Answer with one JSON object and nothing else: {"l3": "pass" or "fail", '
    '"reason": one line, "issues": a list of issue types, "img": 0-10 image consistency or null '
    "when the conversation has no image}."
)

TOOL_CALL_CONTRACT = (
    "You judge the last response of an image-creation assistant that calls tools. "
    "Check it against the user's request, the reference images, the earlier tool results and the "
    "tool schemas. Issue types: wrong_tool (the tool does not fit the request), "
    "missing_param (a required or requested parameter is absent), wrong_param (a value contradicts "
    "the request: resolution, aspect ratio, count, colour, shape), extra_call (a duplicate or "
    "unrequested call), image_mismatch (the call contradicts the reference images). "
    "Hard rules: judge only what is visible; do not infer an aspect ratio from output pixels; do "
    "not call a URL hallucinated unless its origin is traceable. " + OUTPUT_FORMAT
)

TEXT_ONLY_CONTRACT = (
    "You judge the last response of an image-creation assistant. This response calls no tool: "
    "judge the text itself. Issue types: false_completion_claim (claims work that the tool results "
    "do not show), should_have_called_tool (the request needed a tool and none was called), "
    "contradicts_request_or_tool_result (states something the request or a tool result "
    "contradicts), text_hallucination (invents facts, files or numbers), ignores_user_correction "
    "(repeats what the user corrected). Hard rules: no issue may cite a missing tool-call field, "
    "because this turn has no tool call; any such reason is itself a misjudgement. " + OUTPUT_FORMAT
)

# Compact contracts for the embedded default (configs/tiny.py). A randomly initialized CPU judge
# cannot read instructions; for it the contract is a constant prefix that names the route and the
# issue vocabulary. The long texts above cost it ~110 tokens per sample (a third of the training
# time at the tiny sequence lengths) for nothing. Real judges (a policy's SFT checkpoint) use the
# full texts.
COMPACT_OUTPUT_FORMAT = 'JSON: {"l3": "pass"|"fail", "reason", "issues", "img": 0-10 or null}.'
TOOL_CALL_CONTRACT_COMPACT = (
    "Judge the tool call. Issues: wrong_tool, missing_param, wrong_param, extra_call, "
    "image_mismatch. " + COMPACT_OUTPUT_FORMAT)
TEXT_ONLY_CONTRACT_COMPACT = (
    "Judge the text answer (no tool call; never cite a tool-call field). Issues: "
    "false_completion_claim, should_have_called_tool, contradicts_request_or_tool_result, "
    "text_hallucination, ignores_user_correction. " + COMPACT_OUTPUT_FORMAT)

# The minimal contracts of configs/tiny.py: the route alone. Its judge sees ~100-token inputs, where
# even the compact contracts were a third of the text between the request and the verdict slot.
TOOL_CALL_CONTRACT_ROUTE = "Judge the tool call."
TEXT_ONLY_CONTRACT_ROUTE = "Judge the text answer."

TOOL_CALL_ISSUES = ("wrong_tool", "missing_param", "wrong_param", "extra_call", "image_mismatch")
TEXT_ONLY_ISSUES = ("false_completion_claim", "should_have_called_tool",
                    "contradicts_request_or_tool_result", "text_hallucination",
                    "ignores_user_correction")

# The image head of the teacher labeller (rm_jax.label): a separate multimodal teacher that only
# scores image consistency. It receives every image of the conversation and the response, in
# order, as thumbnails (the field report's reverse misjudgements came from sending only the first
# 4: images 5-8 held the evidence).
IMAGE_CONSISTENCY_CONTRACT = (
    "You rate how consistent the last response of an image-creation assistant is with the images "
    "of the conversation: the reference images, the images earlier tool results returned, and the "
    "images the response itself refers to, all attached in order. 10 means the response agrees "
    "with every image (colour, shape, count, which file it uses); 0 means it contradicts them. "
    "Judge only what the images show. "
    'Answer with one JSON object and nothing else: {"img": an integer 0-10, "reason": one line}.'
)
