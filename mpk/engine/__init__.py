"""The LLM engine (planned): requests, continuous batching over a paged block manager, GPU
sampling, and ``mpk.LLM`` / ``mpk.SamplingParams``. Empty until that lands."""
