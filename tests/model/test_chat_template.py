"""The chat template as Hugging Face and llama-server render it: tools, tool calls, HF's extras, template
arguments - and a template's refusal is the client's 400, never a 500."""

from __future__ import annotations

from pathlib import Path

import pytest

from weaved.agent.formats import GENERIC, HERMES, LLAMA3, MISTRAL, detect
from weaved.agent.plan import generic_messages, template_message
from weaved.agent.tools import Tool
from weaved.model.chat_template import ChatTemplate, TemplateError

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
TOOL = {"type": "function", "function": {"name": "f", "description": "<b>&'", "parameters": {"type": "object"}}}


def test_tojson_writes_json_as_python_does_not_html():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    assert t.render([], kwargs={"x": {"a": "<é>&'"}}) == '{"a": "<é>&\'"}|{\n  "a": "<é>&\'"\n}'


def test_extras_and_arguments():
    t = ChatTemplate("{{ bos_token }}{% if enable_thinking is false %}off{% endif %}{{ strftime_now('%Y') | length }}"
                     "{% if add_generation_prompt %}>{% endif %}", bos_token="<s>")
    assert t.render([], kwargs={"enable_thinking": False}) == "<s>off4>"
    with pytest.raises(TemplateError, match="may not set"):
        t.render([], kwargs={"messages": []})
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="alternate") as e:
        refusing.render([{"role": "user", "content": "x"}])
    assert e.value.status == 400
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[5].content }}").render([])


def test_a_template_argument_the_template_never_reads_is_refused_by_name():
    """``chat_template_kwargs`` the template does not read would change nothing: a 400 naming them and what
    the template does read (qwen3's ``enable_thinking``, Llama 3.1's ``date_string``), never silently ignored."""
    qwen3 = ChatTemplate((TEMPLATES / "qwen3.jinja").read_text())
    assert "enable_thinking" in qwen3.variables
    qwen3.render([{"role": "user", "content": "x"}], kwargs={"enable_thinking": False})
    with pytest.raises(TemplateError, match=r"does not read \['thinking'\] \(it reads \['enable_thinking'\]\)") as e:
        qwen3.render([{"role": "user", "content": "x"}], kwargs={"thinking": True})
    assert e.value.param == "chat_template_kwargs" and e.value.status == 400
    plain = ChatTemplate((TEMPLATES / "qwen2.5.jinja").read_text())  # reads nothing beyond the conversation
    with pytest.raises(TemplateError, match="enable_thinking.*no variables beyond the conversation"):
        plain.render([{"role": "user", "content": "x"}], kwargs={"enable_thinking": True})
    dated = ChatTemplate("{% if date_string is not defined %}{% set date_string = 'today' %}{% endif %}"
                         "{{ date_string }}")
    assert dated.render([], kwargs={"date_string": "26 Jul 2024"}) == "26 Jul 2024"  # (Llama 3.1's own argument)
    # a variable set inside the template (a loop's namespace) is not one a request can give
    assert "x" not in ChatTemplate("{% set x = 1 %}{{ x }}").variables


def test_the_sandbox_refuses_reaching_python():
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


def test_hermes_template_renders_tools_calls_and_results():
    t = ChatTemplate((TEMPLATES / "hermes-tools.jinja").read_text())
    msgs = [template_message(m) for m in [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]]
    text = t.render(msgs, tools=[TOOL])
    assert '<tools>\n{"type": "function", "function": {"name": "f", "description": "<b>&\'"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in text  # arguments as an object
    assert "<tool_response>\n42\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_formats_are_detected_from_templates():
    assert detect((TEMPLATES / "hermes-tools.jinja").read_text()) is HERMES
    assert detect((TEMPLATES / "qwen3-tools.jinja").read_text()) is HERMES
    assert detect((TEMPLATES / "qwen2.5.jinja").read_text()) is GENERIC  # no tool branch
    assert detect((TEMPLATES / "gemma3.jinja").read_text()) is GENERIC
    assert detect("{% for t in tools %}[AVAILABLE_TOOLS]{% endfor %}[TOOL_CALLS]") is MISTRAL
    assert detect('<|start_header_id|>{% if tools %}{"name": ..., "parameters": ...}{% endif %}') is LLAMA3
    assert detect(None) is GENERIC


def test_the_generic_format_speaks_any_template():
    msgs = generic_messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], (Tool("f"),))
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\nYou can call")
    assert msgs[2] == {"role": "assistant", "content": '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'}
    assert msgs[3] == {"role": "user", "content": "Result of f (call c1):\n42"}
    gemma = ChatTemplate((TEMPLATES / "gemma3.jinja").read_text(), bos_token="<bos>")
    assert "Result of f" in gemma.render(msgs)  # a template that knows only user and model turns


def test_parallel_calls_results_are_one_user_turn_for_templates_that_alternate():
    """Gemma 3's template raises on two user turns in a row: the results of one answer's calls (and
    words the user adds after them) are one turn."""
    msgs = generic_messages([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "w", "arguments": {"city": "Paris"}}},
            {"id": "c2", "function": {"name": "w", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "22C"},
        {"role": "user", "content": "Which is warmer?"}], (Tool("w"),))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[3]["content"] == ("Result of w (call c1):\n18C\n\nResult of w (call c2):\n22C\n\n"
                                  "Which is warmer?")
    gemma = ChatTemplate((TEMPLATES / "gemma3.jinja").read_text(), bos_token="<bos>")
    text = gemma.render(msgs)
    assert text.count("<start_of_turn>user") == 2 and "22C" in text


class TemplateTokenizer:
    """What AnswerPlan reads of a tokenizer: the template's source and its rendering."""

    def __init__(self, source: str):
        self.chat_template = source
        self._t = ChatTemplate(source, bos_token="<bos>")

    def render_chat(self, msgs, add_generation_prompt=True, tools=None, kwargs=None):
        return self._t.render(msgs, add_generation_prompt=add_generation_prompt, tools=tools, kwargs=kwargs or {})


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "user", "content": "Summarise."}]


@pytest.mark.parametrize("template", ["gemma3.jinja", "qwen2.5.jinja", "hermes-tools.jinja"])
def test_past_calls_stay_in_the_prompt_of_a_turn_that_offers_no_tools(template):
    """A final "summarise" request resends the history without tools: the calls and their arguments are
    still rendered (in the generic format's envelope for a template with no tool branch, which would
    drop them), and no tools are listed."""
    from weaved.agent.plan import AnswerPlan, AnswerSpec

    source = (TEMPLATES / template).read_text()
    text = AnswerPlan(AnswerSpec(), TemplateTokenizer(source), None).render([dict(m) for m in CONVERSATION])
    assert '"city": "Paris"' in text and "18C" in text and "Summarise." in text
    assert "You can call these tools" not in text
