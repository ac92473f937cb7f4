"""``weave bench --scenario prefix``: what shared prefixes save when agents start from the same context.

Sixteen agents share about 2,000 tokens of tool definitions (and a system prompt): one starts first, then
the other fifteen at once, each with its own task - as an orchestrator spawns sub-agents.  The same run
twice, on a fresh daemon each: with shared prefixes (the default) and with ``prefix_cache = false``.
Reported per run: the tokens the engine prefilled, the fifteen's time to first token (p50 / p95, from the
request to the first streamed chunk) and the wall time until all have answered.
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

    @classmethod
    def quick(cls, model: Path) -> PrefixOptions:
        return cls(model, agents=4, tools=12, max_tokens=8)


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


def _turn(sock: Path, tools: list[dict], task: str, max_tokens: int, out: dict) -> None:
    body = {"messages": [{"role": "system", "content": "You are an inventory agent. Use the tools."},
                         {"role": "user", "content": task}], "tools": tools, "tool_choice": "auto",
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=1800) as c, \
            c.stream("POST", "http://weave/v1/chat/completions", json=body) as r:
        if r.status_code != 200:  # (a refusal is no time to first token: the run fails, saying why)
            out["error"] = f"{r.status_code}: {r.read().decode('utf-8', 'replace')[:300]}"
            return
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = str(chunk["error"].get("message", chunk["error"]))
                return
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if "ttft" not in out and any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content")):
                out["ttft"] = time.monotonic() - t0
            if chunk.get("choices") == [] and chunk.get("usage"):
                out["usage"] = chunk["usage"]
    out.setdefault("ttft", time.monotonic() - t0)


def _run(opts: PrefixOptions, share: bool, say: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="weave-prefix-") as tmp:
        work = Path(tmp)
        profile = work / "profile.toml"
        text = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
        profile.write_text(text.replace("[host]", f"[host]\nprefix_cache = {'true' if share else 'false'}", 1))
        served = start(opts.model, work, "--profile", str(profile))
        try:
            tools = tool_definitions(opts.tools)
            first: dict = {}
            _turn(served.socket, tools, "Task 0: check record A-0.", opts.max_tokens, first)
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), timeout=60) as c:
                before = sum(p.get("tokens_prefilled") or 0 for p in c.get("http://weave/v1/status").json()["pools"])
            outs = [{} for _ in range(opts.agents - 1)]
            tasks = [f"Task {i + 1}: check record A-{i + 1}." for i in range(len(outs))]
            threads = [threading.Thread(target=_turn, args=(served.socket, tools, task, opts.max_tokens, out))
                       for task, out in zip(tasks, outs, strict=True)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            failed = [o["error"] for o in (first, *outs) if "error" in o]
            if failed:
                raise RuntimeError(f"{len(failed)} of {len(outs) + 1} requests failed (the first: {failed[0]})")
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), timeout=60) as c:
                status = c.get("http://weave/v1/status").json()
            after = sum(p.get("tokens_prefilled") or 0 for p in status["pools"])
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
              "wall_s": round(wall, 2), "prefixes": status["kv"].get("prefixes")}
    say(f"prefix_cache={share}: {report['prefilled_tokens']} tokens prefilled for {len(outs)} agents, TTFT p50 "
        f"{report['ttft_p50_s']} s, all answered in {report['wall_s']} s")
    return report


def run_prefix_bench(opts: PrefixOptions, say: Callable[[str], None]) -> dict:
    return {"agents": opts.agents, "runs": [_run(opts, True, say), _run(opts, False, say)]}


def format_table(report: dict) -> str:
    lines = [f"{'prefix cache':<13} {'prompt':>7} {'prefilled':>10} {'cached':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
             f"{'all done':>9}"]
    for r in report["runs"]:
        lines.append(f"{'on' if r['prefix_cache'] else 'off':<13} {r['prompt_tokens'] or 0:>7} "
                     f"{r['prefilled_tokens']:>10} {r['cached_tokens']:>8} {r['ttft_p50_s']:>8}s "
                     f"{r['ttft_p95_s']:>8}s {r['wall_s']:>8}s")
    return "\n".join(lines)
