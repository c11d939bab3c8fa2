"""Llama and Qwen3 decoders written to be traced: the config, the model, checkpoint loading (HF
safetensors, GGUF), the tokenizer, the default model, the paged KV cache's page table, and the
model compiled for token-count buckets (prefill)."""

from mpk.llm.buckets import CompileReport, TokenBuckets, default_buckets, prefill
from mpk.llm.checkpoint import load_pretrained
from mpk.llm.config import FAMILIES, SHAPES, LLMConfig, rope_inv_freq, rope_table
from mpk.llm.default_model import default_model_path
from mpk.llm.gguf import load_gguf
from mpk.llm.kv_cache import PagedKVCache
from mpk.llm.model import DecoderLM
from mpk.llm.tokenizer import load_tokenizer

__all__ = ["FAMILIES", "SHAPES", "LLMConfig", "DecoderLM", "PagedKVCache", "load_pretrained", "load_gguf",
           "load_tokenizer", "default_model_path", "rope_inv_freq", "rope_table", "TokenBuckets", "CompileReport",
           "default_buckets", "prefill"]
