"""Models written to be traced. ``toy``: small HF-style decoders and blocks (random weights) for
tests, examples and inspection presets."""
