"""The DART draft head: its layer, its config, its reduced vocabulary, its KV cache, its checkpoints."""
