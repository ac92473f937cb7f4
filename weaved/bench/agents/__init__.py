"""``weave bench --scenario agents``: the reference agent workload replayed against Weave and baselines.

- ``workload``: the parameters (reference defaults) and the seeded plan of what a run asks;
- ``tokens``: exact-length synthetic prompts from seeded text;
- ``replay`` and ``agent_turns``: one daemon driven through the plan in real time, every turn recorded;
- ``metrics``: SLA accounting and percentiles; ``figures``: the daemon's own counters;
- ``configs``: weave, isolation, fifo and gpu-only as profiles; ``capacity``: the agent-count search;
- ``scenario``: all of it, configuration after configuration; ``report``: the tables; ``cli``: options.

Nothing here is imported when the CLI registers its commands; the daemon is imported only by a run.
"""
