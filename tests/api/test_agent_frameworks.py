"""Real agent frameworks as unmodified clients: the OpenAI Agents SDK runs an agent with a function tool
through both its Chat Completions and its Responses model classes, and pydantic-ai gets a typed result."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_q4_0):
    with weave_serve(tmp_path_factory.mktemp("frameworks"), "--model", str(smollm2_q4_0)) as proc:
        yield proc


def _client(socket) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket)), timeout=120.0)
    return openai.AsyncOpenAI(base_url="http://weave/v1", api_key="x", http_client=http, max_retries=0)


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_openai_agents_runs_a_tool(served, model_class):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"18 C and sunny in {city}"

    async def run():
        model = getattr(agents, model_class)(model="default", openai_client=_client(served.socket))
        agent = agents.Agent(name="weather", instructions="Answer weather questions with the tool.",
                             tools=[get_weather], model=model,
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                 max_tokens=80, parallel_tool_calls=False),
                             tool_use_behavior="stop_on_first_tool")
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert asked and all(isinstance(c, str) and c for c in asked)
    assert result.final_output == f"18 C and sunny in {asked[0]}"


def test_pydantic_ai_gets_a_typed_result(served):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str
        country: str

    async def run():
        model = OpenAIChatModel("default", provider=OpenAIProvider(openai_client=_client(served.socket)))
        agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 80})
        return await agent.run("Name a city in France.")

    result = asyncio.run(run())
    assert isinstance(result.output, City) and result.output.name and result.output.country
