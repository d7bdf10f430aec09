"""End-to-end reproduction kit: stock SGLang against SGLang with this plugin, on one install.

The two arms differ only in the kill switches: "stock" sets both to 0, so SGLang runs its own code
paths; "plugin" leaves them unset (default on). The kit launches the servers in an interleaved
order, warms them up, drives SGLang's own load client (``python -m sglang.benchmark.serving``) and a
5-shot GSM8K harness built from ``sglang.test.few_shot_gsm8k``, and turns what they record into the
spec's tables. The command-line scripts are under ``benchmark/e2e/``; ``benchmark/README.md`` shows
one command per table.

- ``protocol``: the arms, the server presets, the interleaved instance order.
- ``server``: one server process per instance, and the HTTP calls the kit makes to it.
- ``sweep``: warm-up, the concurrency sweep, its report (table and plot).
- ``gsm8k``: the accuracy runs and their report.
"""
