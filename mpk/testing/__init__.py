"""What tests, benchmarks, examples and ``mpk inspect`` presets share and the compiler does not
need: toy models, random graphs and decode steps, parity checks against Hugging Face, and a
dependency oracle independent of the compiler's."""
