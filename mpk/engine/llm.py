"""``LLM``: offline batched generation (vLLM's interface) — requests scheduled by continuous
batching over one paged KV cache with prefix caching, each step one launch of the model."""

from __future__ import annotations

import os
import time
import weakref
from contextlib import closing
from dataclasses import replace
from typing import Any, Iterable, Iterator
from typing import Sequence as Seq

import torch

from mpk.engine.block_manager import BlockManager
from mpk.engine.loading import LoadedModel, load_model
from mpk.engine.outputs import CompletionOutput, RequestOutput
from mpk.engine.runner import ModelRunner, default_executor
from mpk.engine.sampling import SamplingParams, mix64
from mpk.engine.scheduler import Scheduler
from mpk.engine.sequence import Sequence
from mpk.engine.stats import EngineStats
from mpk.errors import MpkError, NotSupportedError, OptionError
from mpk.llm.config import is_count
from mpk.llm.model import DecoderLM
from mpk.llm.multistep import MAX_STOPS

Prompt = str | list[int]
Conversation = list[dict[str, str]]

# the share of free memory (after the weights) the default page pool may take: on a GPU most of
# it; in host memory half (the process and the OS need the rest)
MEMORY_FRACTION = {"cuda": 0.85, "cpu": 0.5}


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now (host memory: the OS's available pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


BURST = 8  # decode iterations per launch by default: ~8× fewer launches, tokens streamed per 8


def default_decode_iterations(executor: str, tensor_parallel_size: int = 1) -> int:
    """``LLM``'s ``decode_iterations`` when none is given: ``BURST`` on the GPU executor of one
    GPU (the multi-step graph runs on one GPU), 1 otherwise (the CPU executors are compute-bound:
    a launch's host work is a small share of their step)."""
    return BURST if executor == "gpu" and tensor_parallel_size == 1 else 1


class LLM:
    """A model ready to generate: ``generate``, ``chat`` and ``stream``; or request by request
(as ``mpk serve``'s engine process does): ``add_request``, ``step``, ``abort``.

    ``model``: a local Hugging Face directory (config.json, *.safetensors, a tokenizer), a
    ``.gguf`` file, or None for mpk's default model. ``max_num_seqs``: sequences per step at
    most; ``max_model_len``: tokens per sequence (prompt and output) at most;
    ``max_num_batched_tokens``: new tokens per step at most (decodes first, then prompt
    chunks); ``page_size``: tokens per KV page; ``num_pages``: the page pool (default: enough
    for ``max_num_seqs`` sequences of ``max_model_len``, at most ``MEMORY_FRACTION`` of the
    device's free memory); ``dtype``: bfloat16 on CUDA, float32 on the CPU
    by default; ``executor``: "gpu" (default on CUDA), "eager" (PyTorch; default on the CPU)
    or "cpu" (mpk's CPU interpreter, slow); ``seed``: the seed of requests that give none;
    ``enable_prefix_caching``: share full KV pages of equal prompt prefixes across requests.
    ``tensor_parallel_size``: GPUs (ranks) the model is sharded over, one per visible GPU; the
    engine starts ranks 1…N-1 itself, or joins them under torchrun, where the other ranks'
    ``LLM(...)`` serve rank 0's steps and end their processes (docs/guide.md, "Tensor
    parallelism"); ``close()`` stops them. ``buckets``: the step sizes
    (new tokens) compiled, each its own graph; the largest must be ``max_num_batched_tokens``
    (default ``mpk.llm.default_buckets(max_num_batched_tokens)``: 1, 2, 4, …). A model built in
    the process (random weights): ``LLM.from_model``.

    ``decode_iterations``: when every running sequence decodes and no waiting request can be
    admitted, run up to this many decode iterations in one launch (sampling, stop checks and
    page growth on the device; ``mpk.llm.multistep``), then detokenize, stream and check stop
    strings from what came back. Default (None): ``default_decode_iterations`` — 8 on the GPU
    executor of one GPU, where the host's work per token is what it saves
    (``stats().launches_per_token`` shows it), else 1 (every step its own launch); each
    multi-step graph (one per batch size 1, 2, 4, … ``max_num_seqs``) adds to the compile. A
    burst is skipped for batches with ``logprobs`` or more than ``mpk.llm.multistep.MAX_STOPS``
    stop token ids (EOS included) in a request.
    """

    def __init__(self, model: str | os.PathLike | LoadedModel | None = None, max_num_seqs: int = 64,
                 max_model_len: int = 4096, page_size: int = 16, dtype: torch.dtype | None = None,
                 tensor_parallel_size: int = 1, executor: str | None = None, max_num_batched_tokens: int = 512,
                 num_pages: int | None = None, seed: int = 0, enable_prefix_caching: bool = True,
                 device: str | torch.device | None = None, buckets: Seq[int] | None = None,
                 decode_iterations: int | None = None):
        for name, value, least in (("max_num_seqs", max_num_seqs, 1), ("max_model_len", max_model_len, 2),
                                   ("max_num_batched_tokens", max_num_batched_tokens, 1), ("seed", seed, 0),
                                   ("tensor_parallel_size", tensor_parallel_size, 1),
                                   ("decode_iterations", 1 if decode_iterations is None else decode_iterations, 1)):
            if not is_count(value, least):
                raise OptionError(f"{name}={value!r}; expected an int ≥ {least}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if decode_iterations is None:
            decode_iterations = default_decode_iterations(executor or default_executor(device), tensor_parallel_size)
        self.job = None
        if tensor_parallel_size > 1 and decode_iterations > 1:
            raise NotSupportedError(f"decode_iterations={decode_iterations} with tensor_parallel_size="
                                    f"{tensor_parallel_size}: the multi-step graph runs on one GPU for now "
                                    "(decode_iterations=1)")
        if tensor_parallel_size > 1:
            from mpk.engine.parallel import check_parallel, start_job

            check_parallel(tensor_parallel_size, executor, device, model)
            self.job = start_job(tensor_parallel_size)
            if device.type == "cuda":  # rank 0's GPU (each rank takes the GPU of its local rank)
                device = torch.device("cuda", self.job.info.local_rank)
                torch.cuda.set_device(device)
        try:
            self._build(model, max_num_seqs, max_model_len, page_size, dtype, executor or default_executor(device),
                        max_num_batched_tokens, num_pages, seed, enable_prefix_caching, device, buckets,
                        decode_iterations)
        except BaseException as e:
            if self.job is not None:
                self.job.abort(f"{type(e).__name__}: {e}")
            raise
        self._next_id = 0
        self._stats = EngineStats()
        self._compiled: Any = None  # compile()'s report

    def _build(self, model: str | os.PathLike | LoadedModel | None, max_num_seqs: int, max_model_len: int,
               page_size: int, dtype: torch.dtype, executor: str, max_num_batched_tokens: int, num_pages: int | None,
               seed: int, enable_prefix_caching: bool, device: torch.device, buckets: Seq[int] | None,
               decode_iterations: int) -> None:
        """The model, the page pool, the scheduler and the runner (a tensor-parallel job's:
        ``ParallelRunner``; its workers are told the configuration first, and load the model
        while this rank does)."""
        if self.job is not None:
            from mpk.engine.parallel import EngineConfig, announce

            config = EngineConfig(None if model is None else os.fspath(model), device.type, dtype, executor,
                                  max_num_seqs, max_num_batched_tokens, num_pages, page_size, max_model_len,
                                  None if buckets is None else list(buckets))
            allocator = announce(self.job, config)
        self.model, self.tokenizer, self.eos_ids = load_model(model, dtype, device, max_model_len)
        self.vocab = self.model.cfg.vocab
        self.max_model_len, self.seed = max_model_len, seed
        per_seq = -(-max_model_len // page_size)
        if num_pages is None:
            ranks = self.job.world if self.job is not None and executor == "gpu" else 1  # a rank-local cache
            page_bytes = self.model.cache_bytes_per_page(page_size, ranks)
            fits = int(free_memory(device) * MEMORY_FRACTION.get(device.type, 0.5)) // page_bytes
            num_pages = min(max_num_seqs * per_seq, fits)
        if not is_count(num_pages, per_seq):
            raise OptionError(f"num_pages={num_pages!r}; expected an int ≥ {per_seq}, the pages of one sequence of "
                              f"max_model_len={max_model_len} (default: what fits max_num_seqs × max_model_len and "
                              "free memory; lower max_model_len)")
        self.blocks = BlockManager(num_pages, page_size, prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        if self.job is None:
            self.runner = ModelRunner(self.model, max_num_seqs, max_num_batched_tokens, num_pages, page_size,
                                      max_model_len, executor, buckets, decode_iterations=decode_iterations)
            return
        from mpk.engine.parallel import ParallelRunner

        self.runner = ParallelRunner(self.job, self.model, replace(config, num_pages=num_pages), allocator)
        # the workers are told to stop when this engine goes (at the latest at exit)
        weakref.finalize(self, self.runner.close)

    def compile(self, progress: bool | None = None) -> Any:
        """Trace and build every graph the engine may run (the token buckets, the decode form and
        the multi-step graphs), else each is made at its first use: a server calls this before it
        takes requests, so that no request waits for a trace. Returns the ``CompileReport`` (a
        tensor-parallel job's is the start-up compile's: nothing is traced again)."""
        if self._compiled is None:
            done = self.runner.buckets.report  # a tensor-parallel job's, or a first step's
            self._compiled = done if done is not None and self.runner.decode_iterations == 1 \
                else self.runner.compile(progress)
        return self._compiled

    def close(self) -> None:
        """Stop a tensor-parallel job's workers and leave it (nothing to do on one GPU); the
        engine takes no steps afterwards."""
        if self.job is not None:
            self.runner.close()

    @classmethod
    def from_model(cls, model: DecoderLM, tokenizer: Any = None, eos_ids: Iterable[int] = (),
                   **options: Any) -> "LLM":
        """An engine over a ``DecoderLM`` built in the process (random weights for a benchmark),
        on its device and in its dtype; ``options``: the constructor's others. Without a
        ``tokenizer`` prompts are token-id lists, outputs have no text, and stop strings and
        ``chat`` are refused. ``eos_ids``: the tokens that end generation (none: only
        ``max_tokens``, ``stop_token_ids`` and ``max_model_len`` do)."""
        fixed = sorted({"model", "dtype", "device"} & options.keys())
        if fixed:
            raise OptionError(f"LLM.from_model(..., {', '.join(f'{k}=' for k in fixed)}): the model's own are used; "
                              "expected none of model, dtype, device")
        if not isinstance(model, DecoderLM):
            raise OptionError(f"model of type {type(model).__name__}; expected an mpk.llm.DecoderLM")
        return cls(LoadedModel(model, tokenizer, frozenset(eos_ids)), dtype=model.embed.dtype,
                   device=model.embed.device, **options)

    # --- requests -------------------------------------------------------------------------

    def _prompts(self, prompts: Prompt | Seq[Prompt]) -> list[tuple[str | None, Any]]:
        """(text or None, the prompt as given) per request: a string or a list of strings, or
        token ids (a list of ints, or a list of such lists)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise MpkError(f"prompts of type {type(prompts).__name__}; expected a string, a list of strings or a "
                           "list of token-id lists")
        return [(p if isinstance(p, str) else None, p) for p in prompts]

    def _submit(self, prompts: list[tuple[str | None, Any]],
                params: SamplingParams | Seq[SamplingParams] | None) -> list[Sequence]:
        """A ``Sequence`` per prompt; a bad request is failed at once (``error`` set), the
        others queued."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise MpkError(f"{len(params)} SamplingParams for {len(prompts)} prompts; expected one, or one each")
        try:
            return [self._add(text, given, p) for (text, given), p in zip(prompts, params)]
        except BaseException:  # (a tokenizer error, Ctrl-C) nothing of this call stays queued
            self.scheduler.abort_all()
            raise

    def _add(self, text: str | None, given: Any, params: Any) -> Sequence:
        """A new ``Sequence`` for one prompt: queued, or failed at once (``error`` set)."""
        rid = self._next_id
        self._next_id += 1
        text_prompt = isinstance(given, str) and self.tokenizer is not None  # (without one: _check says so)
        ids = self.tokenizer(given)["input_ids"] if text_prompt else given
        problem = self._check(given, ids, params)
        if problem:  # a placeholder sequence carries the error
            seq = Sequence(rid, text, list(ids) if isinstance(ids, (list, tuple)) else [], SamplingParams(), 0,
                           self.tokenizer)
            seq.fail(problem)
            return seq
        seed = params.seed if params.seed is not None else mix64(mix64(self.seed) ^ rid)
        seq = Sequence(rid, text, list(ids), params, seed, self.tokenizer)
        self.scheduler.add(seq)
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Queue one request (a string or token ids) for ``step`` to run; returns its first,
        empty output: ``request_id`` names it, ``prompt_token_ids`` holds its prompt, and a bad
        request comes back finished with ``error`` set (nothing queued)."""
        seq = self._add(prompt if isinstance(prompt, str) else None, prompt, params or SamplingParams())
        return _output(seq, "", [], None)

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request (its pages freed at once); False if none has that id."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = "abort"
        return seq is not None

    def has_unfinished(self) -> bool:
        """Requests are queued or running: ``step`` has work."""
        return self.scheduler.has_work()

    def _check(self, given: Any, ids: Any, params: Any) -> str | None:
        """Why a request cannot run, or None."""
        if not isinstance(params, SamplingParams):
            return f"params of type {type(params).__name__}; expected SamplingParams"
        try:
            params.validate(self.vocab)
        except MpkError as e:
            return str(e)
        if self.tokenizer is None and (isinstance(given, str) or params.stop_strings):
            what = f"prompt {given!r}" if isinstance(given, str) else f"stop={params.stop!r}"
            return f"{what} needs a tokenizer, and this engine has none (LLM.from_model without one): use token ids"
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return f"prompt {given!r}; expected a string or a list of token ids (ints)"
        if not ids:
            return "empty prompt; expected at least one token"
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {self.vocab})"
        if len(ids) >= self.max_model_len:
            return (f"prompt of {len(ids)} tokens; max_model_len={self.max_model_len} leaves room for prompts of at "
                    f"most {self.max_model_len - 1} tokens (one to generate)")
        return None

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns, per request that got a token, what is new since its
        last output (as ``stream`` yields it). Requires ``has_unfinished()``."""
        rows = self.scheduler.schedule()
        if not rows:
            raise MpkError("the scheduler found no step to run (a sequence needs more pages than the pool holds?)")
        self._stats.launches += 1
        if self._bursts(rows):
            seqs = [r.seq for r in rows]
            tokens = self.runner.burst(seqs, self.blocks, [self._stop_ids(s) for s in seqs])
            if tokens is not None:
                return self._take_burst(seqs, tokens)
        sampled = self.runner.execute(rows)
        self.scheduler.advance(rows)
        changed = []
        for row, got in zip(rows, sampled):
            if got is None:
                continue
            seq = row.seq
            seq.append(got[0], self.eos_ids, self.max_model_len, got[1])
            self._stats.tokens += 1
            if seq.finished:
                self.scheduler.retire(seq)
            changed.append(_output(seq, *seq.take_delta()))
        return changed

    def _stop_ids(self, seq: Sequence) -> list[int]:
        """The token ids that finish ``seq`` (its stop_token_ids, and EOS unless ignore_eos)."""
        p = seq.params
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids)))

    def _bursts(self, rows: list) -> bool:
        """Whether this step runs as a burst of decode iterations: the option is on, every
        running sequence decodes in it (so the scheduler admitted nothing), and none asks for
        what a burst does not give (logprobs; more stop ids than its table holds)."""
        return (self.runner.decode_iterations > 1 and len(rows) == len(self.scheduler.running)
                and all(r.count == 1 and r.samples for r in rows)
                and all(r.seq.params.logprobs is None and len(self._stop_ids(r.seq)) <= MAX_STOPS for r in rows))

    def _take_burst(self, seqs: list[Sequence], tokens: list[list[int]]) -> list[RequestOutput]:
        """Append each sequence's burst tokens one by one, as steps would (stop strings,
        detokenizing), dropping those after it finishes; retire the finished ones."""
        changed = []
        for seq, got in zip(seqs, tokens):
            for t in got:
                seq.append(t, self.eos_ids, self.max_model_len)
                self._stats.tokens += 1
                if seq.finished:
                    break
            if seq.finished:
                self.scheduler.retire(seq)
            else:  # every token but the last is in the cache now
                seq.num_computed = len(seq.token_ids) - 1
                self.blocks.commit(seq.block, seq.token_ids, seq.num_computed)
            changed.append(_output(seq, *seq.take_delta()))
        return changed

    def stats(self) -> EngineStats:
        """Host launches and generated tokens so far (``launches_per_token``)."""
        return self._stats

    def _steps(self) -> Iterator[list[RequestOutput]]:
        """Run steps until every queued request finished, yielding each step's outputs.
        Interrupted (KeyboardInterrupt, an error, the caller closing the iterator), every
        unfinished request is dropped and its pages freed."""
        try:
            while self.scheduler.has_work():
                yield self.step()
        finally:
            self.scheduler.abort_all()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of them, or token-id lists), batched;
        ``params``: one ``SamplingParams`` for all, one per prompt, or None (defaults). Returns
        a ``RequestOutput`` per prompt, in order; a bad request's has ``error`` set and
        finish_reason "error". ``use_tqdm``: a progress bar over requests (tokens/s)."""
        return self._generate(self._prompts(prompts), params, use_tqdm)

    def chat(self, messages: Conversation | Seq[Conversation],
             params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """``generate`` for a conversation ([{"role": ..., "content": ...}, ...]) or a list of
        them, each turned into a prompt by the tokenizer's chat template."""
        return self._generate(self._conversations(messages), params, use_tqdm)

    def _conversations(self, messages: Conversation | Seq[Conversation]) -> list[tuple[str | None, Any]]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return [self.chat_prompt(conv) for conv in convs]

    def chat_prompt(self, conversation: Conversation) -> tuple[str, list[int]]:
        """(text, token ids) of the prompt the tokenizer's chat template makes of a
        conversation, ready for the assistant's reply."""
        return chat_prompt(self.tokenizer, conversation)

    def _generate(self, prompts: list[tuple[str | None, Any]],
                  params: SamplingParams | Seq[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        seqs = self._submit(prompts, params)
        start, tokens_in, tokens_out = time.perf_counter(), 0, 0
        steps = self._steps()
        with tqdm(total=len(seqs), desc="generating", unit="req", disable=not use_tqdm) as bar, closing(steps):
            bar.update(sum(s.finished for s in seqs))  # failed at submission
            for changed in steps:
                tokens_out += sum(len(o.outputs[0].token_ids) for o in changed)
                done = [o for o in changed if o.finished]
                tokens_in += sum(len(o.prompt_token_ids) for o in done)
                if done:
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"in {tokens_in / elapsed:.0f} tok/s, out {tokens_out / elapsed:.0f} tok/s")
                    bar.update(len(done))
        return [_output(s, s.text, s.output_token_ids, s.logprobs) for s in seqs]

    def stream(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[RequestOutput]:
        """Generate as ``generate`` does, yielding a ``RequestOutput`` each time a request has
        new text or tokens: ``outputs[0].text`` and ``.token_ids`` hold only what is new (text
        that could begin a stop string is held back until it cannot), ``finished`` marks its
        last. ``chat``: the prompts are conversations (as ``chat`` takes them). Closing the
        iterator early drops the unfinished requests."""
        seqs = self._submit(self._conversations(prompts) if chat else self._prompts(prompts), params)
        steps = self._steps()
        with closing(steps):  # an iterator closed early drops the unfinished requests at once
            for s in seqs:
                if s.finished:
                    yield _output(s, "", [], None)
            for changed in steps:
                yield from changed

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def prefix_cache_hits(self) -> tuple[int, int]:
        """(pages, tokens) found cached by requests so far."""
        return self.blocks.hit_pages, self.blocks.hit_tokens


def chat_prompt(tokenizer: Any, conversation: Conversation) -> tuple[str, list[int]]:
    """(text, token ids) of the prompt ``tokenizer``'s chat template makes of a conversation,
    ready for the assistant's reply (``LLM.chat_prompt``; also the server's HTTP process, which
    holds the tokenizer but not the engine)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise MpkError("the tokenizer has no chat template; use generate() with a prompt")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def _output(seq: Sequence, text: str, token_ids: list[int], logprobs: list | None) -> RequestOutput:
    completion = CompletionOutput(0, text, list(token_ids), seq.finish_reason, logprobs, seq.stop_reason)
    return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion], seq.finished, seq.error)
