"""Shared prefixes end to end on the real model: a second session with the same long system prompt
prefills only its own tokens and answers with bit-identical log-probabilities; the same after a restart
and after ``kill -9``; a stateless client resending a growing conversation prefills only what is new."""

from __future__ import annotations

import json
import os
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve
from weaved.kv.prefixes import BLOCK

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise about item {i}." for i in range(150))
ASK = {"max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}


def _prefilled(http) -> int:
    return sum(p.get("tokens_prefilled") or 0 for p in http.get("/v1/status").json()["pools"])


def _turn(http, question: str) -> dict:
    sid = http.post("/v1/sessions", json={"system": SYSTEM}).json()["id"]
    r = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": question}], **ASK})
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_share_a_system_prompt_across_restarts(tmp_path, smollm2_q4_0):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        full = _turn(http, "What is 2+2?")
        n = full["usage"]["prompt_tokens"]
        assert n > 1500 and full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        before = _prefilled(http)
        other = _turn(http, "Name a colour.")
        shared = other["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert shared >= (n // BLOCK - 1) * BLOCK  # the system prompt's full blocks
        assert _prefilled(http) - before == other["usage"]["prompt_tokens"] - shared  # only its own tokens
        again = _turn(http, "What is 2+2?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK
        assert again["choices"][0]["logprobs"] == full["choices"][0]["logprobs"]  # bit for bit
        kv = http.get("/v1/status").json()["kv"]["prefixes"]
        assert kv["hits"] >= 2 and kv["reused_tokens"] >= 2 * shared and kv["files"] >= 1
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        after = _turn(http, "What is 2+2?")  # prefix files survive a restart
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK
        assert after["choices"][0]["logprobs"] == full["choices"][0]["logprobs"]
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(30)
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        killed = _turn(http, "What is 2+2?")  # and a kill -9
        assert killed["choices"][0]["logprobs"] == full["choices"][0]["logprobs"]
        assert killed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # the sessions that mapped a prefix before the restarts still answer from it
        for s in http.get("/v1/sessions").json()["data"]:
            r = http.post(f"/v1/sessions/{s['id']}/turns", json={"messages": [{"role": "user", "content": "Why?"}],
                                                                 "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text


def test_a_stateless_client_prefills_only_what_is_new(tmp_path, smollm2_q4_0):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:
        h = httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket)), timeout=300.0)
        sdk = openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}]
        last_total = 0
        ask = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        notes = " ".join(f"Note {i}: keep item {i} in mind." for i in range(20))  # ~200 tokens: a new block
        for i, q in enumerate(["Hello!", "What is 2+2?", "And 3+3?", "Spell out the rules, in order."]):
            messages.append({"role": "user", "content": f"{q} {notes}"})
            out = sdk.chat.completions.create(model="default", messages=messages, **ask)
            cached = out.usage.prompt_tokens_details.cached_tokens
            if i == 0:
                assert cached == 0
            else:  # all of the previous request but its last, partial block
                assert cached >= last_total - BLOCK and out.usage.prompt_tokens - cached < BLOCK + 256
            last_total = out.usage.total_tokens
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
        # the conversation is one stored file, grown by each request's new blocks
        st = h.get("http://weave/v1/status").json()["kv"]["prefixes"]
        assert st["files"] == 1 and st["extended"] >= 2 and st["published"] - st["extended"] == 1
        # the conversation's prefixes stay as a cache until cleared: then it is computed again - and the
        # last answer computed anew is bit for bit the one read from the grown file
        cleared = h.delete("http://weave/v1/prefixes").json()
        assert cleared["object"] == "prefixes.cleared" and cleared["files"] >= 1 and cleared["bytes"] > 0
        assert h.get("http://weave/v1/status").json()["kv"]["prefixes"]["files"] == 0
        fresh = sdk.chat.completions.create(model="default", messages=messages[:-1], **ask)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].logprobs.model_dump() == out.choices[0].logprobs.model_dump()


def test_diverging_conversations_store_their_shared_start_once(tmp_path, smollm2_q4_0):
    """Two stateless conversations with one long system prompt: the second's file holds only its own blocks
    past the first's (a branch); a request that maps the chain answers as one computed from nothing."""
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:
        h = httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket)), timeout=300.0)
        sdk = openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)
        ask = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        tail = " ".join(f"Detail {i} of the task matters." for i in range(40))  # ~300 tokens of its own

        def chat(question: str):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question} {tail}"}]
            return sdk.chat.completions.create(model="default", messages=messages, **ask)

        first = chat("Summarise the rules.")
        second = chat("Which rule is the longest?")
        n1, n2 = first.usage.prompt_tokens, second.usage.prompt_tokens
        assert second.usage.prompt_tokens_details.cached_tokens >= 1500 // BLOCK * BLOCK
        st = h.get("http://weave/v1/status").json()["kv"]["prefixes"]
        assert st["files"] == 2 and st["branched"] == 1 and st["branches"] == 1
        block_bytes = BLOCK * 30 * 2 * 3 * 64 * 2  # SmolLM2: 30 layers of K and V, 3 kv heads of 64, float16
        assert st["bytes"] < 0.75 * (n1 // BLOCK + n2 // BLOCK) * block_bytes  # whole files: the sum
        again = chat("Which rule is the longest?")  # maps the root and the branch
        assert again.usage.prompt_tokens_details.cached_tokens == (n2 - 1) // BLOCK * BLOCK
        assert again.choices[0].logprobs.model_dump() == second.choices[0].logprobs.model_dump()
        assert h.delete("http://weave/v1/prefixes").json()["files"] == 2
        fresh = chat("Which rule is the longest?")
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].logprobs.model_dump() == second.choices[0].logprobs.model_dump()


def test_a_fork_continues_as_its_parent_then_goes_its_own_way(tmp_path, smollm2_q4_0):
    q = {"max_tokens": 10, "temperature": 0, "logprobs": True}
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        sid = http.post("/v1/sessions", json={"system": SYSTEM}).json()["id"]
        first = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "Count to 3."}],
                                                             **q}).json()
        assert first["choices"][0]["message"]["content"]
        fork = http.post(f"/v1/sessions/{sid}/fork", json={"sla": {"class": "background"}}).json()
        at1 = http.post(f"/v1/sessions/{sid}/fork", json={"turn": 1}).json()
        assert fork["forked_from"] == sid and fork["shared_tokens"] >= BLOCK and fork["sla"]["class"] == "background"
        nxt = {"messages": [{"role": "user", "content": "And to 5?"}], **q}
        a = http.post(f"/v1/sessions/{sid}/turns", json=nxt).json()
        b = http.post(f"/v1/sessions/{fork['id']}/turns", json=nxt).json()
        c = http.post(f"/v1/sessions/{at1['id']}/turns", json=nxt).json()
        # greedy: the fork answers exactly as the parent would have, from the shared context
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"] == c["choices"][0]["logprobs"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["total_tokens"] - 1
        # then they diverge independently
        d = http.post(f"/v1/sessions/{fork['id']}/turns", json={"messages": [{"role": "user", "content": "Why?"}],
                                                                   **q}).json()
        e = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "Spell it."}],
                                                         **q}).json()
        assert d["usage"]["prompt_tokens"] != e["usage"]["prompt_tokens"]
        parent_view = http.get(f"/v1/sessions/{sid}").json()["messages"]
        fork_view = http.get(f"/v1/sessions/{fork['id']}").json()["messages"]
        assert [m["content"] for m in parent_view if m["role"] == "user"] == ["Count to 3.", "And to 5?", "Spell it."]
        assert [m["content"] for m in fork_view if m["role"] == "user"] == ["Count to 3.", "And to 5?", "Why?"]
        http.delete(f"/v1/sessions/{sid}")  # the fork keeps working without its parent
        r = http.post(f"/v1/sessions/{fork['id']}/turns", json={"messages": [{"role": "user", "content": "Ok."}],
                                                                 "max_tokens": 3})
        assert r.status_code == 200
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        again = http.post(f"/v1/sessions/{at1['id']}/turns", json={"messages": [{"role": "user", "content": "Ok."}],
                                                                    "max_tokens": 3})
        assert again.status_code == 200, again.text  # a fork survives a restart
        for s in http.get("/v1/sessions").json()["data"]:
            http.delete(f"/v1/sessions/{s['id']}")
        assert http.get("/v1/status").json()["kv"]["prefixes"]["in_use"] == 0  # the last user went


def _prompt_metric(http) -> float:
    line = next((x for x in http.get("/metrics").text.splitlines()
                 if x.startswith('weave_tokens_total{kind="prompt",sla_class="interactive"}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_n_choices_come_from_one_prefill(tmp_path, smollm2_q4_0):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc, uds_client(proc.socket, timeout=300.0) as http:
        h = httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket)), timeout=300.0)
        sdk = openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)
        msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
        before, counted = _prefilled(http), _prompt_metric(http)
        a = sdk.chat.completions.create(model="default", messages=msgs, n=4, max_tokens=12, temperature=0.9, seed=7)
        prompt = a.usage.prompt_tokens
        # one prefill of the prompt; each other choice feeds only the prompt's last token again
        assert _prefilled(http) - before == prompt + 3
        assert _prompt_metric(http) - counted == prompt  # the request's prompt, counted once as its usage does
        assert [c.index for c in a.choices] == [0, 1, 2, 3]
        assert len({c.message.content for c in a.choices}) > 1 and a.usage.completion_tokens <= 48
        b = sdk.chat.completions.create(model="default", messages=msgs, n=4, max_tokens=12, temperature=0.9, seed=7)
        assert [c.message.content for c in b.choices] == [c.message.content for c in a.choices]
        greedy = sdk.chat.completions.create(model="default", messages=msgs, n=3, max_tokens=8, temperature=0)
        assert len({c.message.content for c in greedy.choices}) == 1  # the same logits row for each
        streamed: dict[int, str] = {}
        for chunk in sdk.chat.completions.create(model="default", messages=msgs, n=4, max_tokens=12,
                                                 temperature=0.9, seed=7, stream=True):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        assert [streamed[i] for i in range(4)] == [c.message.content for c in a.choices]
        comp = sdk.completions.create(model="default", prompt="Once upon a time", n=3, max_tokens=6, seed=3,
                                      temperature=1.0)
        assert [c.index for c in comp.choices] == [0, 1, 2]
        # constrained answers: each choice has its own grammar state from the answer's start
        schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                                   "lines": {"type": "integer"}}, "required": ["title", "lines"]}
        before = _prefilled(http)
        shaped = sdk.chat.completions.create(model="default", messages=msgs, n=3, max_tokens=60, temperature=0.9,
                                             seed=5, response_format={"type": "json_schema", "json_schema": {
                                                 "name": "poem", "schema": schema}})
        # one prefill of what is not cached (the same prompt again: its short blocks are copied)
        cached = shaped.usage.prompt_tokens_details.cached_tokens
        assert cached >= 16 and _prefilled(http) - before == shaped.usage.prompt_tokens - cached + 2
        for c in shaped.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), schema)
        tool = {"type": "function", "function": {"name": "rhyme", "parameters": {
            "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"]}}}
        called = sdk.chat.completions.create(model="default", messages=msgs, n=2, max_tokens=60, temperature=0.9,
                                             seed=5, tools=[tool], tool_choice="required",
                                             parallel_tool_calls=False)
        for c in called.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "rhyme", c
            assert isinstance(json.loads(c.message.tool_calls[0].function.arguments)["word"], str)
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model="default", messages=msgs, n=17, max_tokens=4)
