"""The OpenAI-compatible HTTP server over the engine (planned: ``mpk serve``). Empty until that
lands."""
