"""``weave bench --scenario prefix``: what shared prefixes save when agents start from the same context.

Sixteen agents share about 2,000 tokens of tool definitions (and a system prompt): one starts first, then
the other fifteen at once, each with its own task - as an orchestrator spawns sub-agents.  The same run
twice, on a fresh daemon each: with shared prefixes (the default) and with ``prefix_cache = false``.
Reported per run: the tokens the engine prefilled, the fifteen's time to first token (p50 / p95, from the
request to the first streamed chunk) and the wall time until all have answered.  Then every agent works
on (``turns`` rounds, the agents of a round at once): it sends its whole conversation again, as the
OpenAI SDK does, with its last answer and a tool's result of about 300 tokens appended; reported for
these rounds: the tokens prefilled, their wall time, and what the stored prefixes hold at the end (their
bytes and files: conversations that diverge after the shared context).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import httpx

from weaved.bench.load.daemon import start


@dataclass(frozen=True)
class PrefixOptions:
    model: Path
    agents: int = 16
    tools: int = 13  # about 2,000 tokens of definitions and prompt on SmolLM2's tokenizer
    max_tokens: int = 16
    turns: int = 3  # rounds of work after the first answers

    @classmethod
    def quick(cls, model: Path) -> PrefixOptions:
        return cls(model, agents=4, tools=12, max_tokens=8, turns=1)


def tool_definitions(n: int) -> list[dict]:
    """``n`` plausible tools (deterministic): what an agent framework sends with every request."""
    out = []
    for i in range(n):
        out.append({"type": "function", "function": {
            "name": f"tool_{i}_lookup",
            "description": f"Look up record kind {i} in the inventory database and return its fields, history and "
                           f"owner; use it when the task mentions kind {i} or anything stored with it.",
            "parameters": {"type": "object", "properties": {
                "record_id": {"type": "string", "description": f"The id of the kind-{i} record"},
                "fields": {"type": "array", "items": {"type": "string"}, "description": "Fields to return"},
                "include_history": {"type": "boolean", "description": "Also return the change history"}},
                "required": ["record_id"]}}})
    return out


def tool_result(agent: int, turn: int) -> str:
    """About 300 tokens a tool returned (deterministic, its own for each agent and round)."""
    rows = "; ".join(f"field {k} of record A-{agent} is {(agent * 7919 + turn * 104729 + k * 31) % 100000}"
                     for k in range(24))
    return f"Result of the lookup, round {turn}: {rows}."


def follow_up(out: dict, result: str) -> list[dict]:
    """What an agent sends after an answer, as the OpenAI SDK's agents do: the answer as it came (its
    calls with their ids), then each call's result - or, for an answer that called nothing, the result
    as the user's next message."""
    calls = [out["calls"][k] for k in sorted(out.get("calls") or {})]
    if not calls:
        return [{"role": "assistant", "content": out.get("text") or ""}, {"role": "user", "content": result}]
    return [{"role": "assistant", "content": out.get("text") or None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls)]


def _turn(sock: Path, tools: list[dict], messages: list[dict], max_tokens: int, out: dict) -> None:
    body = {"messages": messages, "tools": tools, "tool_choice": "auto",
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    for _ in range(RETRIES):
        if _stream(sock, body, t0, out):
            return
        time.sleep(out.pop("wait"))
    out["error"] = f"refused {RETRIES} times: {out.pop('refused')}"


RETRIES = 60  # 503s a request waits out (each its Retry-After, at most 5 s) before the run fails


def _stream(sock: Path, body: dict, t0: float, out: dict) -> bool:
    """One try of a request, streamed into ``out``; False when the daemon answered 503 (admission: the pool
    is at capacity) and the request should be sent again after its ``Retry-After``."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=1800) as c, \
            c.stream("POST", "http://weave/v1/chat/completions", json=body) as r:
        if r.status_code == 503:
            out["refused"] = r.read().decode("utf-8", "replace")[:300]
            out["retries"] = out.get("retries", 0) + 1
            out["wait"] = min(5.0, float(r.headers.get("retry-after") or 1))
            return False
        if r.status_code != 200:  # (a refusal is no time to first token: the run fails, saying why)
            out["error"] = f"{r.status_code}: {r.read().decode('utf-8', 'replace')[:300]}"
            return True
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = str(chunk["error"].get("message", chunk["error"]))
                return True
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            out["text"] = out.get("text", "") + (delta.get("content") or "")
            for call in delta.get("tool_calls") or ():  # assembled as the SDKs do: by index
                calls = out.setdefault("calls", {})
                got = calls.setdefault(call.get("index", 0), {"id": "", "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
                got["id"] += call.get("id") or ""
                for k in ("name", "arguments"):
                    got["function"][k] += (call.get("function") or {}).get(k) or ""
            if "ttft" not in out and any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content")):
                out["ttft"] = time.monotonic() - t0
            if chunk.get("choices") == [] and chunk.get("usage"):
                out["usage"] = chunk["usage"]
    out.setdefault("ttft", time.monotonic() - t0)
    return True


def _run(opts: PrefixOptions, share: bool, say: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="weave-prefix-") as tmp:
        work = Path(tmp)
        profile = work / "profile.toml"
        text = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
        profile.write_text(text.replace("[host]", f"[host]\nprefix_cache = {'true' if share else 'false'}", 1))
        served = start(opts.model, work, "--profile", str(profile))
        try:
            tools = tool_definitions(opts.tools)
            talks = [[{"role": "system", "content": "You are an inventory agent. Use the tools."},
                      {"role": "user", "content": f"Task {i}: check record A-{i}."}] for i in range(opts.agents)]
            first: dict = {}
            _turn(served.socket, tools, talks[0], opts.max_tokens, first)
            if "error" in first:
                raise RuntimeError(f"the first agent's request failed: {first['error']}")
            before = _prefilled(served.socket)[0]
            outs, wall = _round(served.socket, tools, talks[1:], opts.max_tokens)
            after, status = _prefilled(served.socket)
            answers, work_wall, refused = [first, *outs], 0.0, sum(o.get("retries", 0) for o in (first, *outs))
            for turn in range(opts.turns):  # every agent works on: its answer and a tool's result appended
                for i, (talk, out) in enumerate(zip(talks, answers, strict=True)):
                    talk += follow_up(out, tool_result(i, turn))
                answers, took = _round(served.socket, tools, talks, opts.max_tokens)
                work_wall += took
                refused += sum(o.get("retries", 0) for o in answers)
            worked, status = _prefilled(served.socket)
        finally:
            served.stop()
    ttfts = sorted(o["ttft"] for o in outs)
    prompt = first.get("usage", {}).get("prompt_tokens")
    report = {"prefix_cache": share, "prompt_tokens": prompt, "agents_after_first": len(outs),
              "prefilled_tokens": after - before,
              "cached_tokens": sum((o.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                   for o in outs),
              "ttft_p50_s": round(statistics.median(ttfts), 3),
              "ttft_p95_s": round(ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 3),
              "wall_s": round(wall, 2), "turns": opts.turns, "work_prefilled_tokens": worked - after,
              "work_wall_s": round(work_wall, 2), "refused_503": refused, "prefixes": status["kv"].get("prefixes")}
    say(f"prefix_cache={share}: {report['prefilled_tokens']} tokens prefilled for {len(outs)} agents, TTFT p50 "
        f"{report['ttft_p50_s']} s, all answered in {report['wall_s']} s; {opts.turns} rounds of work: "
        f"{report['work_prefilled_tokens']} tokens prefilled in {report['work_wall_s']} s ({refused} requests "
        f"refused with 503 and sent again)")
    return report


def _round(sock: Path, tools: list[dict], talks: list[list[dict]], max_tokens: int) -> tuple[list[dict], float]:
    """One request of each conversation, all at once: (their outcomes, the wall time until the last)."""
    outs = [{} for _ in talks]
    threads = [threading.Thread(target=_turn, args=(sock, tools, talk, max_tokens, out))
               for talk, out in zip(talks, outs, strict=True)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [o["error"] for o in outs if "error" in o]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed (the first: {failed[0]})")
    return outs, time.monotonic() - t0


def _prefilled(sock: Path) -> tuple[int, dict]:
    """The tokens the daemon's engines have prefilled, and its status."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
        status = c.get("http://weave/v1/status").json()
    return sum(p.get("tokens_prefilled") or 0 for p in status["pools"]), status


def run_prefix_bench(opts: PrefixOptions, say: Callable[[str], None]) -> dict:
    return {"agents": opts.agents, "runs": [_run(opts, True, say), _run(opts, False, say)]}


def format_table(report: dict) -> str:
    lines = [f"{'prefix cache':<13} {'prompt':>7} {'prefilled':>10} {'cached':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
             f"{'all done':>9} {'work prefilled':>15} {'work time':>10} {'stored':>15}"]
    for r in report["runs"]:
        pre = r.get("prefixes") or {}
        stored = f"{pre.get('bytes', 0) / 1e6:.0f} MB, {pre.get('files', 0)} files" if r["prefix_cache"] else "-"
        lines.append(f"{'on' if r['prefix_cache'] else 'off':<13} {r['prompt_tokens'] or 0:>7} "
                     f"{r['prefilled_tokens']:>10} {r['cached_tokens']:>8} {r['ttft_p50_s']:>8}s "
                     f"{r['ttft_p95_s']:>8}s {r['wall_s']:>8}s {r['work_prefilled_tokens']:>15} "
                     f"{r['work_wall_s']:>9}s {stored:>15}")
    return "\n".join(lines)
