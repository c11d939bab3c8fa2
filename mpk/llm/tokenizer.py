"""``load_tokenizer``: the transformers fast tokenizer of a HF checkpoint directory or of a GGUF
file (its vocabulary, merges and chat template are in the file's metadata)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from mpk.errors import MpkError
from mpk.executors.build import cache_dir
from mpk.llm.gguf import check_gguf_file


def load_tokenizer(path: str | os.PathLike):
    """A transformers fast tokenizer: ``AutoTokenizer.from_pretrained`` of a HF checkpoint
    directory, or of a GGUF file (``gguf_file=``), whose ``tokenizer.chat_template`` metadata
    becomes the tokenizer's chat template (``apply_chat_template``).

    Raises ``MpkError`` for a path that is neither a directory nor a readable GGUF file, or a
    directory without tokenizer files or a GGUF file whose tokenizer transformers cannot
    build. The architecture is not checked here (``load_gguf`` refuses the model). A GGUF
    file's converted tokenizer is kept under ``$MPK_CACHE_DIR/tokenizers`` (default
    ``~/.cache/mpk``), so later loads of the same file skip the conversion."""
    from transformers import AutoTokenizer

    if not isinstance(path, (str, os.PathLike)):
        raise MpkError(f"path={path!r}; expected a checkpoint directory or a GGUF file (str or os.PathLike)")
    path = Path(path)
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise MpkError(f"{path} holds no tokenizer transformers can load ({e}); expected tokenizer.json or "
                           "tokenizer_config.json with its vocabulary files") from None
    # a clear error for a missing file or another format; not the architecture, which would parse
    # the metadata a second time (load_gguf refuses the model)
    check_gguf_file(path)
    # transformers converts a GGUF vocabulary in seconds (49k entries: ~9 s on 2 cores); the
    # result is kept as a tokenizer directory under the cache, keyed by the file's identity
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    saved = cache_dir() / "tokenizers" / key
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except (OSError, ValueError):  # a damaged entry: convert again below
            pass
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:  # a tokenizer model transformers does not convert
        raise MpkError(f"{path}: transformers cannot build a tokenizer from its metadata ({e}); expected "
                       "tokenizer.ggml.* metadata of a gpt2 (BPE) or llama (SentencePiece) tokenizer") from None
    try:  # into a fresh folder, renamed into place whole: a reader never sees half an entry
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent, prefix=".tmp-")
        try:
            tok.save_pretrained(tmp)
            os.replace(tmp, saved)
        except OSError:  # (another process got there first, or the disk is full)
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:  # an unwritable cache costs the next load its conversion, nothing else
        pass
    return tok
