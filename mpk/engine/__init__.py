"""The LLM engine: ``LLM`` (offline batched generation) over a ``Scheduler`` (continuous
batching, chunked prefill, preemption), a ``BlockManager`` (one paged KV pool, prefix caching)
and a ``ModelRunner`` (a step through ``mpk.llm.TokenBuckets``, then ``sample``). ``mpk.LLM``,
``mpk.SamplingParams`` and ``mpk.RequestOutput`` are the public names."""
