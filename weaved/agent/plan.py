"""One chat turn's answer: how its prompt is rendered, what constrains it, how it is parsed back.

``AnswerSpec`` is what the request asked (tools, tool choice, response format, template arguments);
``AnswerPlan`` joins it to the served model's chat template and vocabulary: the call format the
template speaks (``weaved.agent.formats``), whether it thinks (``<think>``), the grammar that makes
every call parse and validate (``weaved.agent.grammar_text``), and the parser that splits the text
back into reasoning, content and calls (``weaved.agent.stream``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from weaved.agent.formats import GENERIC, CallFormat, detect, generic_system_text
from weaved.agent.grammar import GrammarEngine
from weaved.agent.grammar_text import AnswerShape, LarkWriter, answer_grammar
from weaved.agent.stream import THINK_CLOSE, THINK_OPEN, AnswerParser
from weaved.agent.tools import ChoiceMode, Tool, ToolChoice, arguments_object
from weaved.engine.constraint import TokenConstraint
from weaved.errors import InvalidRequest

# parallel_tool_calls when a request leaves it out: false, as llama.cpp's server has it (OpenAI's is true) -
# a small model allowed more than one call tends to repeat the same call until max_tokens or the context
# ends the answer
DEFAULT_PARALLEL = False

# free text that does not start (blanks aside) with the generic envelope's calls
PAST_CALLS_NO_CALL = r"""start: NOCALL
NOCALL: /(.|\n)*/ & ~/[ \t\r\n]*\{[ \t\r\n]*"tool_calls"(.|\n)*/
"""


@dataclass(frozen=True)
class AnswerSpec:
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = DEFAULT_PARALLEL  # parallel_tool_calls: more than one call per answer
    schema: dict | None = None  # response_format: the content's JSON schema
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs
    format_field: str = "response_format"  # the request's name for the schema's field (errors name it)

    @property
    def constrained(self) -> bool:
        """Whether the answer is held to a grammar (tools offered, or a response format)."""
        return bool(self.tools) or self.schema is not None

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names must be unique", param="tools")
        if self.choice.mode is ChoiceMode.FUNCTION and self.choice.name not in names:
            raise InvalidRequest(f"tool_choice names function {self.choice.name!r}, which is not among the tools",
                                 param="tool_choice")
        if self.choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION) and not self.tools:
            raise InvalidRequest(f"tool_choice {self.choice.mode.value!r} needs tools", param="tool_choice")


class AnswerPlan:
    def __init__(self, spec: AnswerSpec, tokenizer, grammar: GrammarEngine | None):
        self.spec = spec
        self._tok = tokenizer
        self._grammar = grammar
        source = tokenizer.chat_template or ""
        # tools are rendered whenever given (with choice "none" too, so a conversation's prompt does not
        # change with the choice); the grammar decides whether the answer may call one
        self.offers_tools = bool(spec.tools)
        self.fmt: CallFormat = detect(source) if self.offers_tools else GENERIC
        # a template with no tool branch drops past calls (and may refuse tool turns): a conversation
        # that has them is written as the generic format writes it, even when this turn offers no tools
        self._generic_history = detect(source) is GENERIC
        thinking_off = spec.template_kwargs.get("enable_thinking") is False
        self.thinking = THINK_OPEN in source and not thinking_off
        self.in_reasoning = False  # set by render: the prompt itself opened <think>
        self.past_calls = False  # set by render: past calls written as the generic envelope, no tools now

    # ---- the prompt --------------------------------------------------------------------------------
    def render(self, messages: list[dict]) -> str:
        """The prompt text for the whole conversation ``messages`` (transcript entries and this turn's)."""
        tools = None
        msgs = [template_message(m) for m in messages]
        if self.offers_tools:
            if self.fmt.template_tools:
                tools = [t.to_openai() for t in self.spec.tools]
            else:
                msgs = generic_messages(msgs, self.spec.tools, json_answer=self.spec.schema is not None)
        elif self._generic_history and any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
            msgs = generic_messages(msgs, ())
            self.past_calls = True
        text = self._tok.render_chat(msgs, add_generation_prompt=True, tools=tools,
                                     kwargs=self.spec.template_kwargs)
        self.in_reasoning = self.thinking and text.rstrip().endswith(THINK_OPEN)
        return text

    # ---- the constraint ----------------------------------------------------------------------------
    @property
    def shape(self) -> AnswerShape:
        s = self.spec
        tools = s.tools if s.choice.mode is ChoiceMode.NONE else s.choice.callable_tools(s.tools)
        return AnswerShape(self.fmt, tools, s.choice.mode, s.parallel, s.schema, self.thinking, self.in_reasoning)

    def grammar_text(self) -> str | None:
        shape = self.shape
        if not shape.constrained:
            # a turn that offers no tools after turns that called some, written as the envelope: the model
            # may copy that shape, and with no tools there is no call to parse it into - it would be
            # content.  Its answer is free text that does not open the envelope's calls.
            if self.past_calls and not self.thinking and self._grammar is not None:
                return PAST_CALLS_NO_CALL
            return None
        return answer_grammar(shape, LarkWriter(self._special_id))

    def constraint(self) -> TokenConstraint | None:
        """The grammar's constraint for one sequence (None when nothing is constrained)."""
        lark = self.grammar_text()
        if lark is None:
            return None
        if self._grammar is None:
            raise InvalidRequest("constrained output is not available on this daemon")
        fmt_field = self.spec.format_field
        if not self.offers_tools:
            return self._grammar.compile(lark, param=fmt_field)
        try:
            return self._grammar.compile(lark, param="tools")
        except InvalidRequest:
            if self.spec.schema is not None:  # which part cannot be enforced: the format's schema alone?
                alone = AnswerShape(self.fmt, schema=self.spec.schema)
                self._grammar.compile(answer_grammar(alone, LarkWriter(self._special_id)), param=fmt_field)
            raise

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        return frozenset(self._tok.eog_ids)

    def grammar_ends(self) -> str | None:
        """What in the request lets the grammar, not the model, decide where the answer ends (a schema,
        calls, the generic envelope: each closes, and then only the end of turn may follow), as words for
        an error; None when the answer is free text."""
        s = self.spec
        if s.schema is not None:
            return s.format_field
        if self.offers_tools and self.fmt.name == GENERIC.name:  # (first: "none" would not help here)
            return "tools on this model (its answers are a JSON envelope, whatever the tool_choice)"
        if s.tools and s.choice.mode is not ChoiceMode.NONE:
            return 'tools (unless tool_choice is "none")'
        return None

    @property
    def stops_until(self) -> str | None:
        """Where stop strings stop applying: an answer that may be text or calls (``tool_choice`` auto in a
        format whose calls start with a marker, no schema) is free text until that marker - a stop string
        ends the text, never a call.  None when the whole answer is one or the other."""
        s = self.spec
        if s.tools and s.choice.mode is ChoiceMode.AUTO and s.schema is None and self.fmt.trigger:
            return self.fmt.trigger
        return None

    @property
    def reasoning(self) -> tuple[str, str] | None:
        """The markers of the reasoning block the answer may start with (stop strings apply after it, to
        the visible answer alone), or None when the template does not think."""
        return (THINK_OPEN, THINK_CLOSE) if self.thinking else None

    def parser(self, call_seed: str | None = None) -> AnswerParser:
        """The answer's parser.  With ``tool_choice`` "none" no call is parsed (text that spells a call's
        marker out is text), except the generic format's envelope, which that answer still has."""
        none = self.spec.choice.mode is ChoiceMode.NONE and self.fmt.name != GENERIC.name
        return AnswerParser(self.fmt if self.offers_tools and not none else None, thinking=self.thinking,
                            in_reasoning=self.in_reasoning, call_seed=call_seed, envelope=self.spec.schema is None)

    def _special_id(self, text: str) -> int | None:
        return self._grammar.special_id(text) if self._grammar is not None else None


def template_message(m: dict) -> dict:
    """A transcript or request message as chat templates take it: content a string, a call's
    arguments an object (templates write them with ``tojson``)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": arguments_object(c["function"].get("arguments"))}}
                             for c in m["tool_calls"]]
    return out


def generic_messages(msgs: list[dict], tools: tuple[Tool, ...], json_answer: bool = False) -> list[dict]:
    """The conversation for a template with no tool branch: the tools and the answer's envelope in the
    system turn (none when ``tools`` is empty: a turn that offers none), past calls as the envelope the
    model writes, tool results as user turns (the results of one answer's calls in one turn: templates
    such as Gemma 3's refuse two user turns in a row)."""
    names: dict[str, str] = {}
    out: list[dict] = []
    results = False  # out[-1] is a user turn of tool results: more results (and user words) join it
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                calls.append({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
            results = False
        elif m["role"] == "tool":
            cid = m.get("tool_call_id") or ""
            name = m.get("name") or names.get(cid, "the tool")
            result = f"Result of {name} (call {cid}):\n{m['content']}"
            if results:  # parallel calls' results: one user turn, as templates that alternate roles need
                out[-1]["content"] += "\n\n" + result
            else:
                out.append({"role": "user", "content": result})
                results = True
        elif m["role"] == "user" and results:  # a user's words after the results
            out[-1]["content"] += "\n\n" + (m["content"] or "")
        else:
            out.append({"role": m["role"], "content": m["content"]})
            results = False
    if not tools:
        return out
    system = generic_system_text(tools, json_answer)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out
