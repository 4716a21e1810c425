"""Golden tests of the policy-text parser (rm_jax.serve.toolcalls) on the shapes Qwen chat
templates write: Hermes JSON blocks (Qwen3 / Qwen3-VL) and Qwen3-Coder XML blocks (Qwen3.5).

``xml_call`` writes a call the way the Qwen3.5 / Qwen3-Coder templates render an assistant tool
call: ``<tool_call>\\n<function=NAME>\\n``, then per argument ``<parameter=K>\\nVALUE\\n</parameter>\\n``
(mappings and lists as JSON, everything else as its text; here
booleans and None in their JSON spelling, as a policy writes them), then ``</function>\\n</tool_call>``.
"""

import json

from configs import tiny
from rm_jax.serve.toolcalls import CallFormat, convert_value, format_of_template, parse_raw_response

TOOLS = [{"type": "function", "function": {"name": "edit_image", "parameters": {"type": "object", "properties": {
    "prompt": {"type": "string"}, "steps": {"type": "integer"}, "strength": {"type": "number"},
    "keep_size": {"type": "boolean"}, "regions": {"type": "array"}, "style": {"type": "object"},
    "seed": {"type": ["integer", "null"]}}}}},
    {"name": "search", "parameters": {"properties": {"q": {"type": "string"}}}}]


def xml_call(name: str, args: dict) -> str:
    out = f"<tool_call>\n<function={name}>\n"
    for k, v in args.items():
        text = json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)
        out += f"<parameter={k}>\n{text}\n</parameter>\n"
    return out + "</function>\n</tool_call>"


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def calls(parsed):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]


def test_xml_calls_typed_by_the_schema_several_calls_and_mixed_text():
    a = {"prompt": "a red fox\non two lines", "steps": 30, "strength": 0.75, "keep_size": True,
         "regions": [[0, 0, 10, 10]], "style": {"tone": "warm"}, "seed": None}
    b = {"q": "fox <b>bold</b> & 1 < 2"}
    text = "I will edit it, then search.\n\n" + xml_call("edit_image", a) + "\n" + xml_call("search", b) + "<|im_end|>"
    parsed = parse_raw_response(text, tools=TOOLS)
    assert parsed.malformed == 0 and parsed.content == "I will edit it, then search."
    assert calls(parsed) == [("edit_image", a), ("search", b)]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]


def test_xml_value_holding_closing_tag_text_and_unknown_parameter():
    value = 'write "</parameter" and </parameter> literally, then <parameter=x> too'
    text = xml_call("search", {"q": value, "lang": "12"})
    parsed = parse_raw_response(text, tools=TOOLS)
    assert parsed.malformed == 0
    # "lang" is not in the schema: kept as the raw string, not typed
    assert calls(parsed) == [("search", {"q": value, "lang": "12"})]


def test_xml_unparsable_values_stay_raw_strings():
    assert convert_value("3O", "integer") == "3O" and convert_value("yes", "boolean") == "yes"
    assert convert_value("{bad", "object") == "{bad" and convert_value("7", "string") == "7"
    assert convert_value("NULL", "integer") is None and convert_value("2.0", "number") == 2
    assert convert_value("2.5", "number") == 2.5 and convert_value("False", "boolean") is False
    parsed = parse_raw_response(xml_call("edit_image", {"steps": "thirty"}), tools=TOOLS)
    assert calls(parsed) == [("edit_image", {"steps": "thirty"})]
    # no schema at all (the tool is unknown): every value is text
    assert calls(parse_raw_response(xml_call("paint", {"n": 3}), tools=TOOLS)) == [("paint", {"n": "3"})]


def test_think_is_not_judged_and_a_call_inside_it_is_not_a_call():
    thought = "Maybe call " + xml_call("search", {"q": "nope"}) + " ... no."
    text = "<think>\n" + thought + "\n</think>\n\nDone, no tool needed."
    parsed = parse_raw_response(text, tools=TOOLS)
    assert parsed.content == "Done, no tool needed." and parsed.tool_calls == () and parsed.malformed == 0
    assert parsed.reasoning == thought
    kept = parse_raw_response(text, tools=TOOLS, keep_think=True)
    assert kept.tool_calls == () and kept.content.startswith("<think>") and "no." in kept.content
    # Qwen3.5's thinking template opens <think> in the generation prompt: the completion only closes it
    opened = parse_raw_response("plan it\n</think>\n\n" + xml_call("search", {"q": "x"}), tools=TOOLS)
    assert opened.content is None and calls(opened) == [("search", {"q": "x"})] and opened.reasoning == "plan it"
    # an empty think block (thinking disabled) is nothing
    assert parse_raw_response("<think>\n\n</think>\n\nhi").to_json() == {"content": "hi", "tool_calls": []}


def test_unclosed_think_or_call_gates():
    think = parse_raw_response("<think>\nstill thinking about " + hermes_call("search", {"q": "a"}))
    assert think.malformed == 1 and [c["function"]["name"] for c in think.tool_calls] == [""]
    for cut in (xml_call("search", {"q": "abc"})[:-len("</tool_call>")],      # no closing tag
                "<tool_call>\n<function=search>\n<parameter=q>\nabc"):
        parsed = parse_raw_response("ok " + cut, tools=TOOLS)
        assert parsed.malformed == 1 and parsed.content == "ok" and calls(parsed)[0][0] == ""
    # a block whose parameter never closes, or with stray text between parameters
    broken = "<tool_call>\n<function=search>\n<parameter=q>\nabc\n</function>\n</tool_call>"
    stray = "<tool_call>\n<function=search>\nhello\n<parameter=q>\nabc\n</parameter>\n</function>\n</tool_call>"
    for body in (broken, stray):
        assert parse_raw_response(body, tools=TOOLS).malformed == 1


def test_hermes_blocks_and_the_format_the_template_names():
    args = {"prompt": "a red fox", "steps": 4}
    text = "Sure.\n" + hermes_call("edit_image", args) + "\n" + hermes_call("search", {"q": "x"})
    assert calls(parse_raw_response(text)) == [("edit_image", args), ("search", {"q": "x"})]
    both = hermes_call("search", {"q": "x"}) + "\n" + xml_call("search", {"q": "y"})
    auto = parse_raw_response(both, tools=TOOLS)            # the first block decides
    assert auto.malformed == 1 and calls(auto)[0] == ("search", {"q": "x"})
    xml_only = parse_raw_response(both, tools=TOOLS, call_format=CallFormat.XML)
    assert xml_only.malformed == 1 and calls(xml_only)[1] == ("search", {"q": "y"})
    assert format_of_template('... <function=example_function_name> ...') is CallFormat.XML
    assert format_of_template('{"name": <function-name>, "arguments": <args-json-object>}') is CallFormat.HERMES
    assert format_of_template("{{ messages }}") is CallFormat.AUTO


def test_embedded_template_names_hermes_and_keeps_tool_tags_when_special_tokens_are_skipped(renderer):
    tok = renderer.tokenizer
    assert format_of_template(tok.chat_template) is CallFormat.HERMES
    text = "ok " + hermes_call("search", {"q": "x"})
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for tag in ("<tool_call>", "</tool_call>"):      # still one added token each, at its old id
        assert tok.convert_tokens_to_ids(tag) == tiny.SPECIAL_TOKENS.index(tag) and tag not in tok.all_special_tokens
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    # TRL and verl decode completions with skip_special_tokens=True: the tags must survive
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert parse_raw_response(tok.decode(ids[:-3], skip_special_tokens=True)).malformed == 1
