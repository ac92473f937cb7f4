"""The prefix scenario's table: the first answers, the rounds of work after them, and what the stored
prefixes hold at the end (only where the cache was on)."""

from __future__ import annotations

from weaved.bench.prefix import format_table, tool_result


def _run(share: bool) -> dict:
    return {"prefix_cache": share, "prompt_tokens": 1956, "prefilled_tokens": 312 if share else 29352,
            "cached_tokens": 29040 if share else 0, "ttft_p50_s": 1.5, "ttft_p95_s": 1.6, "wall_s": 1.7,
            "turns": 3, "work_prefilled_tokens": 20785 if share else 134881, "work_wall_s": 58.0,
            "refused_503": 0, "prefixes": {"files": 26, "bytes": 542_638_080} if share else None}


def test_the_table_says_what_the_rounds_prefilled_and_what_is_stored():
    lines = format_table({"agents": 16, "runs": [_run(True), _run(False)]}).splitlines()
    assert "work prefilled" in lines[0] and "stored" in lines[0]
    assert "20785" in lines[1] and lines[1].endswith("543 MB, 26 files")
    assert "134881" in lines[2] and lines[2].endswith("-")


def test_each_agent_and_round_gets_its_own_tool_result():
    results = {tool_result(a, t) for a in range(4) for t in range(3)}
    assert len(results) == 12 and tool_result(1, 2) == tool_result(1, 2)


def test_an_answer_goes_back_as_the_sdks_send_it():
    from weaved.bench.prefix import follow_up

    called = {"text": "", "calls": {1: {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
                                    0: {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}}}}
    sent = follow_up(called, "rows")
    assert sent[0] == {"role": "assistant", "content": None, "tool_calls": [called["calls"][0], called["calls"][1]]}
    assert [(m["role"], m["tool_call_id"]) for m in sent[1:]] == [("tool", "c1"), ("tool", "c2")]
    assert follow_up({"text": "done"}, "rows") == [{"role": "assistant", "content": "done"},
                                                   {"role": "user", "content": "rows"}]
