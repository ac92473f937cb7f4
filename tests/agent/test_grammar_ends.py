"""Where a constrained answer ends is the grammar's to decide: sampling fields that would decide it too
(a stop string, a stop token, min_tokens) are refused with a 400 naming the field, not left to cut the
JSON short or to leave the sampler no token at all; and a schema's refusal names the request's field."""

from __future__ import annotations

from pathlib import Path

import pytest

from weaved.agent.grammar import GrammarEngine
from weaved.agent.plan import AnswerPlan, AnswerSpec
from weaved.agent.tools import ChoiceMode, Tool, ToolChoice
from weaved.daemon.turns import turn_constraint
from weaved.engine.sampling import SamplingParams
from weaved.errors import InvalidRequest

HERMES_TEMPLATE = Path(__file__).parents[1] / "data" / "templates" / "hermes-tools.jinja"
TOOL = Tool("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def generic(smollm2_q4_0):
    """SmolLM2's own template: no tool branch, so calls and answers are a JSON envelope."""
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_q4_0)
    return tok, GrammarEngine(tok)


@pytest.fixture(scope="module")
def hermes(smollm2_q4_0):
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_q4_0, chat_template=HERMES_TEMPLATE.read_text())
    return tok, GrammarEngine(tok)


def _refused(model, spec: AnswerSpec, **params) -> InvalidRequest | None:
    tok, engine = model
    try:
        turn_constraint(AnswerPlan(spec, tok, engine), SamplingParams(max_tokens=40, **params))
    except InvalidRequest as e:
        return e
    return None


BOUND = [
    pytest.param(AnswerSpec(schema=SCHEMA), "response_format", id="schema"),
    pytest.param(AnswerSpec(tools=(TOOL,), choice=ToolChoice(ChoiceMode.REQUIRED)), "tools", id="required"),
    pytest.param(AnswerSpec(tools=(TOOL,)), "tools", id="auto"),
]


@pytest.mark.parametrize("spec, cause", BOUND)
@pytest.mark.parametrize("model", ["generic", "hermes"])
def test_stop_and_min_tokens_are_refused_where_the_grammar_ends_the_answer(request, model, spec, cause):
    served = request.getfixturevalue(model)
    for field, value in (("stop", ("}",)), ("min_tokens", 3)):
        if field == "stop" and model == "hermes" and spec.tools and spec.choice.mode is ChoiceMode.AUTO:
            # text or calls: stop strings end the text before a call starts (<tool_call>), never a call
            assert _refused(served, spec, stop=value) is None
            continue
        e = _refused(served, spec, **{field: value})
        assert e is not None and e.param == field, (field, e)
        assert cause in e.message and "the grammar decides where the answer ends" in e.message
        # on the generic envelope no tool_choice frees the answer: the refusal does not suggest "none"
        assert ("none" in e.message) == (model == "hermes" and bool(spec.tools)), e.message
    eog = min(served[0].eog_ids)
    assert _refused(served, spec, stop=(), min_tokens=0, stop_token_ids=(eog,)) is None  # nothing asked, or the end
    brace = served[0].encode("}", add_bos=False)[0]
    assert _refused(served, spec, stop_token_ids=(brace,)).param == "stop_token_ids"


def test_free_text_keeps_stop_and_min_tokens(generic, hermes):
    assert _refused(generic, AnswerSpec(), stop=("}",), min_tokens=3) is None
    # choice "none" in a format with its own call syntax: the answer is free text the grammar never ends
    none = AnswerSpec(tools=(TOOL,), choice=ToolChoice(ChoiceMode.NONE))
    assert _refused(hermes, none, stop=("}",), min_tokens=3) is None
    # ... but the generic envelope is JSON even then
    e = _refused(generic, none, stop=("}",))
    assert e is not None and e.param == "stop" and "JSON envelope" in e.message


def test_a_schema_refusal_names_the_requests_own_field(generic):
    bad = {"type": "object", "uniqueItems": True, "properties": {"a": {"type": "array", "uniqueItems": True}}}
    for field in ("response_format", "text.format"):
        e = _refused(generic, AnswerSpec(schema=bad, format_field=field))
        assert e is not None and e.param == field and e.message.startswith(f"{field} cannot be enforced: "), e


@pytest.mark.parametrize("model", ["generic", "hermes"])
def test_with_tool_choice_none_no_call_is_parsed_from_the_answer(request, model):
    """``tool_choice: "none"``: an answer that spells a call's marker out in plain text is text, never a
    call (the grammar only keeps the marker's special token out); the generic format's envelope is still
    unwrapped."""
    tok, engine = request.getfixturevalue(model)
    plan = AnswerPlan(AnswerSpec(tools=(TOOL,), choice=ToolChoice(ChoiceMode.NONE)), tok, engine)
    plan.render([{"role": "user", "content": "hi"}])
    text = ('{"response": "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": {\\"a\\": 1}}\\n</tool_call>"}'
            if model == "generic" else '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    p = plan.parser()
    p.push(text)
    p.finish()
    assert p.answer.calls == []
    assert p.answer.content == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
