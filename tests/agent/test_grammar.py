"""The grammar of an answer, on SmolLM2's real vocabulary: every call a walk through the mask can write
parses and validates against its tool's schema; each tool choice is enforced; the trigger works as
text and as a special token; masks are cheap."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from weaved.agent.formats import GENERIC, HERMES, LLAMA3, MISTRAL, CallFormat
from weaved.agent.grammar import GrammarEngine
from weaved.agent.grammar_text import AnswerShape, LarkWriter, answer_grammar, closed
from weaved.agent.stream import AnswerParser
from weaved.agent.tools import ChoiceMode, Tool
from weaved.errors import InvalidRequest

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]})
COUNT = Tool("count", "", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                           "required": ["n"]})
TOOLS = (WEATHER, COUNT)
SCHEMAS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def tok(smollm2_q4_0):
    from weaved.model.tokenizer import Tokenizer

    return Tokenizer(smollm2_q4_0)


@pytest.fixture(scope="module")
def engine(tok):
    return GrammarEngine(tok)


def writer(tok, engine) -> LarkWriter:
    return LarkWriter(engine.special_id)


_closers: dict[int, np.ndarray] = {}


def walk(tok, c, rng, limit=400) -> list[int] | None:
    """Tokens a random walk through the masks writes until an end-of-generation token (None if it did
    not end within ``limit``).  It leans towards tokens that close strings and objects, so it ends."""
    out = []
    if id(tok) not in _closers:
        _closers[id(tok)] = np.asarray([i for i in range(tok.vocab_size)
                                        if any(ch in tok.token_bytes(i) for ch in b'"}],')])
    closers = _closers[id(tok)]
    for _ in range(limit):
        allowed = np.flatnonzero(c.allowed())
        assert allowed.size, "an empty mask"
        eog = [t for t in allowed if t in tok.eog_ids]
        lean = np.intersect1d(allowed, closers)
        if eog and rng.random() < 0.5:
            t = int(eog[0])
        elif lean.size and rng.random() < 0.4:
            t = int(rng.choice(lean))
        else:
            t = int(rng.choice(allowed))
        if t in tok.eog_ids:
            return out
        c.accept(t)
        out.append(t)
    return None


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, GENERIC], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", [ChoiceMode.AUTO, ChoiceMode.REQUIRED, ChoiceMode.FUNCTION, ChoiceMode.NONE])
@pytest.mark.parametrize("parallel", [True, False])
def test_every_walk_through_the_mask_is_a_valid_answer(tok, engine, fmt: CallFormat, mode, parallel):
    tools = TOOLS if mode is not ChoiceMode.FUNCTION else (COUNT,)
    shape = AnswerShape(fmt, tools, mode, parallel)
    lark = answer_grammar(shape, writer(tok, engine))
    rng = np.random.default_rng(7)
    ended = 0
    for _ in range(6):
        toks = walk(tok, engine.compile(lark), rng)
        if toks is None:
            continue
        ended += 1
        p = AnswerParser(fmt)
        p.push(tok.decode(toks))
        p.finish()
        ans = p.answer
        if mode in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION):
            assert ans.calls and not ans.content.strip(), tok.decode(toks)
        if mode is ChoiceMode.NONE:
            assert not ans.calls and "<tool_call>" not in ans.content and "[TOOL_CALLS]" not in ans.content
        if not parallel or fmt.sep is None:
            assert len(ans.calls) <= 1
        for call in ans.calls:
            assert call.name in {t.name for t in tools}
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if ans.calls and fmt is not LLAMA3 and fmt is not GENERIC:
            assert "<tool_call>" not in ans.content
    assert ended >= 3


def test_choices_are_enforced_token_by_token(tok, engine):
    w = writer(tok, engine)
    enc = lambda s: tok.encode(s, add_bos=False)  # noqa: E731
    required = engine.compile(answer_grammar(AnswerShape(HERMES, TOOLS, ChoiceMode.REQUIRED), w))
    assert required.valid_prefix(enc("Sure")) == 0  # no text before the call
    good = '<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>'
    assert required.valid_prefix(enc(good)) == len(enc(good))
    named = engine.compile(answer_grammar(AnswerShape(HERMES, (COUNT,), ChoiceMode.FUNCTION), w))
    other = enc('<tool_call>\n{"name": "get_weather"')
    assert named.valid_prefix(other) < len(other)
    bad_args = enc('<tool_call>\n{"name": "count", "arguments": {"n": "three"')
    assert required.valid_prefix(bad_args) < len(bad_args)
    auto = engine.compile(answer_grammar(AnswerShape(HERMES, TOOLS, ChoiceMode.AUTO), w))
    text = enc("Let me count. ")
    assert auto.valid_prefix(text) == len(text)
    for t in enc("Let me count.<tool_call>"):
        auto.accept(t)
    allowed = np.flatnonzero(auto.allowed())
    assert [tok.decode([int(t)]) for t in allowed] == ["\n"]  # the trigger forces the call's syntax


def test_a_special_token_trigger(tok, engine):
    """A format whose trigger is one control token of the vocabulary (as <tool_call> is in Qwen's):
    text, then that token, then the calls; the token cannot be spelled out as text."""
    im = "<|im_start|>"
    fmt = CallFormat("test", trigger=im, open="", before=im, args_key="arguments", after="}", sep="", close="")
    w = writer(tok, engine)
    assert w.special(im) is None  # not one of the markers this writer knows; patch it in
    w._special[im] = tok.encode(im, add_bos=False, special=True)[0]
    lark = answer_grammar(AnswerShape(fmt, (COUNT,), ChoiceMode.AUTO), w)
    assert f"<[{w._special[im]}]>" in lark
    c = engine.compile(lark)
    for t in tok.encode("Counting.", add_bos=False):
        c.accept(t)
    c.accept(w._special[im])
    allowed = np.flatnonzero(c.allowed())
    assert tok.decode([int(allowed[0])]).startswith("{")


def test_json_schema_content_and_closed_objects(tok, engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "tags": {"type": "array", "items": {"type": "object",
                                                        "properties": {"k": {"type": "integer"}}}}},
              "required": ["name", "tags"]}
    assert closed(schema)["additionalProperties"] is False
    assert closed(schema)["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed({"type": "object", "additionalProperties": True, "properties": {}})["additionalProperties"] is True
    lark = answer_grammar(AnswerShape(GENERIC, schema=schema), writer(tok, engine))
    rng = np.random.default_rng(3)
    ended = 0
    for _ in range(6):
        toks = walk(tok, engine.compile(lark), rng)
        if toks is not None:
            ended += 1
            jsonschema.validate(json.loads(tok.decode(toks)), schema)
    assert ended >= 3


def test_an_unenforceable_schema_is_a_clear_400(engine):
    with pytest.raises(InvalidRequest, match="response_format"):
        engine.compile('start: %json {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')


def test_masks_cost_microseconds(tok, engine):
    """Not a timing assertion: the mask of a step is computed into a reused buffer and unpacked in numpy;
    this checks its shape and dtype (``weave bench --scenario grammar`` measures its cost)."""
    c = engine.compile(answer_grammar(AnswerShape(GENERIC, TOOLS, ChoiceMode.AUTO), writer(tok, engine)))
    m = c.allowed()
    assert m.dtype == bool and m.shape == (tok.vocab_size,) and 0 < m.sum() < tok.vocab_size


@pytest.mark.parametrize("schema, doc", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}),
    ({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"name": {"type": "string"}}, "required": ["name"]}]},
     {"id": 1, "name": "x"}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1, "b": 2}),
], ids=["allOf", "allOf-ref", "required-undeclared", "beside-anyOf"])
def test_closing_objects_never_refuses_what_the_schema_allows(tok, engine, schema, doc):
    """Objects whose other keys come from elsewhere (an allOf branch, a reference, an applicator beside
    them, a required key they do not declare) stay open: the schema compiles and a document valid under
    it is written token by token through the mask."""
    jsonschema.validate(doc, schema)
    lark = answer_grammar(AnswerShape(GENERIC, schema=schema), writer(tok, engine))
    c = engine.compile(lark)
    toks = tok.encode(json.dumps(doc), add_bos=False)
    assert c.valid_prefix(toks) == len(toks)
    # nested objects of their own are still closed
    nested = {"type": "object", "properties": {"x": schema, "o": {"type": "object", "properties": {"k": {}}}}}
    assert closed(nested)["properties"]["o"]["additionalProperties"] is False


def test_a_schema_the_engine_cannot_compile_is_named_with_its_detail(tok, engine):
    """The client reads what is wrong with its schema, without the grammar Weave wrote around it."""
    lark = answer_grammar(AnswerShape(GENERIC, schema={"type": "string", "pattern": "(ab"}), writer(tok, engine))
    with pytest.raises(InvalidRequest) as e:
        engine.compile(lark)
    assert e.value.message == ("response_format cannot be enforced: failed to compile JSON schema: regex parse "
                               "error: (ab: unclosed group")


def _call_text(fmt: CallFormat, name: str, arguments: str) -> str:
    return fmt.open + fmt.before + fmt.head() + name + fmt.mid() + arguments + fmt.after + fmt.close


@pytest.mark.parametrize("params", [
    {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"]}, {"type": "string", "maxLength": 4}, {"type": "array"}]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
     "nullable": True},
], ids=["no-type", "anyOf-with-other-types", "nullable"])
@pytest.mark.parametrize("fmt", [HERMES, GENERIC], ids=lambda f: f.name)
def test_a_calls_arguments_are_an_object_whatever_the_schema_leaves_open(tok, engine, fmt, params):
    """A tool schema without ``type`` (or one whose anyOf offers other types) allows any JSON value, but a
    call's arguments are an object: the grammar forces one - token by token, and on every walk."""
    tool = Tool("f", "", params)
    lark = answer_grammar(AnswerShape(fmt, (tool,), ChoiceMode.REQUIRED), writer(tok, engine))
    enc = lambda s: tok.encode(s, add_bos=False)  # noqa: E731
    for args in ('"abc"', "[1]", "null", "7"):
        text = enc(_call_text(fmt, "f", args))
        assert engine.compile(lark).valid_prefix(text) < len(text), args
    good = enc(_call_text(fmt, "f", '{"a": 3}'))
    assert engine.compile(lark).valid_prefix(good) == len(good)
    rng = np.random.default_rng(5)
    ended = 0
    for _ in range(6):
        toks = walk(tok, engine.compile(lark), rng)
        if toks is None:
            continue
        ended += 1
        p = AnswerParser(fmt)
        p.push(tok.decode(toks))
        p.finish()
        assert p.answer.calls, tok.decode(toks)
        for call in p.answer.calls:
            args = json.loads(call.arguments)
            assert isinstance(args, dict), call.arguments
            jsonschema.validate(args, params)
    assert ended >= 3


def test_nullable_allows_null_as_openapi_means_it(tok, engine):
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "nullable": True, "description": "x"},
        "b": {"$ref": "#/$defs/B"}, "c": {"type": "string", "nullable": False},
        "nullable": {"type": "boolean"}},  # a property of that name is a property, not the keyword
        "required": ["a", "b", "c", "nullable"],
        "$defs": {"B": {"type": "object", "properties": {"k": {"type": "integer"}}, "nullable": True}}}
    out = closed(schema)
    assert out["properties"]["a"] == {"anyOf": [{"type": "integer", "description": "x"}, {"type": "null"}]}
    assert out["properties"]["c"] == {"type": "string"}
    assert out["properties"]["nullable"] == {"type": "boolean"}
    assert out["$defs"]["B"]["anyOf"][0]["additionalProperties"] is False  # still closed, inside the branch
    root = closed({"type": "object", "nullable": True, "$defs": {"x": {"type": "integer"}},
                   "properties": {"x": {"$ref": "#/$defs/x"}}})
    assert set(root) == {"$defs", "anyOf"}  # definitions stay where references find them
    lark = answer_grammar(AnswerShape(GENERIC, schema=schema), writer(tok, engine))
    for doc in ({"a": None, "b": None, "c": "s", "nullable": True},
                {"a": 1, "b": {"k": 2}, "c": "", "nullable": False}):
        text = tok.encode(json.dumps(doc), add_bos=False)
        assert engine.compile(lark).valid_prefix(text) == len(text), doc
    c_null = tok.encode(json.dumps({"a": 1, "b": None, "c": None}), add_bos=False)
    assert engine.compile(lark).valid_prefix(c_null) < len(c_null)  # nullable false allows no null


@pytest.mark.parametrize("opened", [False, True])
def test_only_a_few_blanks_may_follow_the_reasoning(tok, engine, opened):
    """After ``</think>`` the answer may start after a blank line (what templates write), not after
    whitespace without end: a random model would pad there until max_tokens."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shape = AnswerShape(GENERIC, schema=schema, thinking=True, reasoning_open=opened)
    c = engine.compile(answer_grammar(shape, writer(tok, engine)))
    enc = lambda s: tok.encode(s, add_bos=False)  # noqa: E731
    for t in enc(("" if opened else "<think>") + "Hm.</think>") + enc("\n\n"):
        c.accept(t)
    allowed = [tok.token_bytes(int(t)) for t in np.flatnonzero(c.allowed())]
    assert allowed and not [b for b in allowed if b and not b.strip()]  # no more whitespace
    assert all(b.startswith(b"{") for b in allowed if b)  # the answer itself


def test_a_turn_without_tools_after_calls_cannot_write_the_envelopes_calls(tok, engine):
    """A conversation whose past calls are written as the generic envelope, in a turn that offers no
    tools: the model may copy the shape, and with no tools nothing would parse it - it would be content.
    The answer is free text (JSON too) that does not open the envelope's calls; without past calls it is
    not constrained at all."""
    from weaved.agent.plan import AnswerPlan, AnswerSpec

    enc = lambda s: tok.encode(s, add_bos=False)  # noqa: E731
    call = {"id": "call_1", "type": "function", "function": {"name": "count", "arguments": '{"n": 3}'}}
    history = [{"role": "user", "content": "Count to three."},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "1 2 3"},
               {"role": "user", "content": "Thanks. And now?"}]
    plan = AnswerPlan(AnswerSpec(), tok, engine)
    plan.render(history)
    c = plan.constraint()
    assert c is not None
    for text in ('{"tool_calls": [', ' \n{ "tool_calls"'):
        assert c.valid_prefix(enc(text)) < len(enc(text))
    for text in ("It counted to three.", '{"n": 4}', "The tool_calls were fine."):
        assert plan.constraint().valid_prefix(enc(text)) == len(enc(text))
    plain = AnswerPlan(AnswerSpec(), tok, engine)
    plain.render(history[:1])
    assert plain.constraint() is None and AnswerPlan(AnswerSpec(), tok, None).constraint() is None
