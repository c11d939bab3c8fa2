"""``mpk serve``: an OpenAI-compatible HTTP server over ``mpk.LLM`` (FastAPI and uvicorn).

``protocol``: the request and response bodies in OpenAI's shapes; ``engine``: ``AsyncEngine``,
which feeds asyncio handlers' requests to the engine's step loop in a process of its own
(``engine_process``; a process, so that the loop and HTTP do not share a GIL); ``app``: the routes, errors
and authentication; ``metrics``: the Prometheus metrics; ``server``: ``mpk serve`` (uvicorn,
graceful SIGTERM); ``bench``: ``mpk bench serve``, a load sweep against a running server.
Needs the ``serve`` extra (``pip install mpk[serve]``)."""
