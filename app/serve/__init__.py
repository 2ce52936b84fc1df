"""`moechat serve`: OpenAI's HTTP API over the chat app's engine process, with /metrics and the live stats.

`wire` reads requests and writes OpenAI's shapes, `jobs` runs them one at a time on the engine from a
bounded queue, `metrics` writes Prometheus' text, `server` wires the routes, `command` is the CLI.
The engine and the tuner import none of this: the web framework lives here only.
"""
