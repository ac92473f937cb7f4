"""Constrained decoding inside the batch engine: a constrained sequence leaves the free ones in its batch
bit-identical, and speculative decoding with a grammar emits exactly the tokens of plain decoding."""

from __future__ import annotations

import json

import jsonschema

from tests.engine_run import Run, same, turn
from weaved.agent.formats import GENERIC
from weaved.agent.grammar import GrammarEngine
from weaved.agent.grammar_text import AnswerShape, LarkWriter, answer_grammar
from weaved.agent.stream import AnswerParser
from weaved.agent.tools import ChoiceMode, Tool
from weaved.engine.speculative import SpecConfig

ITEM = Tool("add_item", "", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                              "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
                             "required": ["name", "qty"]})


def _constraint(tok, tools=(ITEM,), mode=ChoiceMode.REQUIRED):
    engine = GrammarEngine(tok)
    lark = answer_grammar(AnswerShape(GENERIC, tools, mode), LarkWriter(lambda text: None))
    return lambda: engine.compile(lark, param="tools")


def test_a_constrained_neighbour_changes_nothing_for_free_sequences(smol, tokenizer):
    free = [turn(f"free{i}", tokenizer.encode(p), max_tokens=24, logprobs=3)
            for i, p in enumerate(["The capital of France is", "def fib(n):", "Once upon a time"])]
    bound = {**turn("bound", tokenizer.encode("Add two apples to the list."), max_tokens=60),
             "constraint": _constraint(tokenizer)}
    alone = Run(smol, free, None, tokenizer=tokenizer)
    mixed = Run(smol, [*free, bound], None, tokenizer=tokenizer)
    for t in free:  # tokens, their text and their log-probabilities (from the very logits rows): identical
        assert mixed.events[t["id"]] == alone.events[t["id"]]
        assert mixed[t["id"]].generated == alone[t["id"]].generated
    text = "".join(ev["text"] for ev in mixed.events["bound"] if ev["type"] == "token")
    p = AnswerParser(GENERIC)
    p.push(text)
    p.finish()
    done = [c for c in p.answer.calls if c.complete]  # (the token limit may cut the last call)
    assert done, text
    for c in done:
        jsonschema.validate(json.loads(c.arguments), ITEM.parameters)


def test_speculation_with_a_grammar_gives_exactly_the_plain_tokens(smol, tokenizer):
    """A prompt full of the calls the answer will repeat, so drafts are proposed (and cut where the grammar
    refuses them): plain and speculative runs emit the same tokens, events and KV."""
    call = '{"tool_calls": [{"name": "add_item", "arguments": {"name": "apple", "qty": 2}}]}'
    prompt = tokenizer.encode(f"Earlier answers:\n{call}\n{call}\n{call}\nNext answer:\n")
    t = {**turn("s", prompt, max_tokens=40, logprobs=2), "constraint": _constraint(tokenizer)}
    plain = Run(smol, [t], None, tokenizer=tokenizer)
    fast = Run(smol, [t], SpecConfig(draft_tokens=6, ngram_sizes=(3, 2, 1)), tokenizer=tokenizer)
    same(plain, fast)
    assert fast.counters.accepted > 0, "no draft accepted: the test would pass vacuously"
