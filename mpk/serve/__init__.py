"""``mpk serve``: an OpenAI-compatible HTTP server over ``mpk.LLM`` (FastAPI and uvicorn).

``protocol``: the request and response bodies in OpenAI's shapes; ``engine``: ``AsyncEngine``,
the engine's step loop on its own thread, fed by asyncio handlers; ``app``: the routes, errors
and authentication; ``metrics``: the Prometheus metrics; ``server``: ``mpk serve`` (uvicorn,
graceful SIGTERM); ``bench``: ``mpk bench serve``, a load sweep against a running server.
Needs the ``serve`` extra (``pip install mpk[serve]``)."""
