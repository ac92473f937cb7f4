"""``weave run --raw``: a prompt continued as it stands (the completions API), for a base model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner
from weaved.cli.app import app

from tests.cli.fake_server import FakeDaemon, short_socket_dir

runner = CliRunner()


@pytest.fixture
def fake():
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as f:
        yield f


def weave(fake: FakeDaemon, *args: str, input: str | None = None):
    env = {"WEAVE_SOCKET": str(fake.socket_path), "WEAVE_API_KEY": None, "WEAVE_DEBUG": None}
    return runner.invoke(app, list(args), input=input, env=env)


def test_raw_streams_a_text_completion_of_the_prompt_as_it_stands(fake):
    res = weave(fake, "run", "--raw", "Once upon a time")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "You said: Once upon a time.\n"
    seen = fake.requests[-1]
    assert seen.path == "/v1/completions"
    # the completions API's own default answer is 16 tokens: --raw asks for 256 unless told
    assert seen.body == {"prompt": "Once upon a time", "sla": {"class": "interactive"}, "max_tokens": 256,
                         "stream": True}


def test_raw_passes_its_options_and_says_when_the_token_limit_cut_it(fake):
    res = weave(fake, "run", "--raw", "-", "--max-tokens", "2", "--temperature", "0", "--sla", "batch",
                input="from stdin")
    assert res.exit_code == 0 and res.stdout == "You said:\n"
    assert "token limit" in res.stderr
    body = fake.requests[-1].body
    assert (body["prompt"], body["max_tokens"], body["temperature"], body["sla"]) == \
        ("from stdin", 2, 0.0, {"class": "batch"})


def test_raw_json_prints_the_completion(fake):
    res = weave(fake, "run", "--raw", "hi", "--json")
    data = json.loads(res.stdout)
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == "You said: hi."


def test_raw_refuses_a_system_prompt_before_asking_the_daemon(fake):
    res = weave(fake, "run", "--raw", "hi", "--system", "be terse")
    assert res.exit_code == 2 and "--system needs the chat template" in res.stderr
    assert not fake.requests
