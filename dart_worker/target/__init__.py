"""The target LLM driven for tree decoding: adapter, batch state, KV cache, tree attention, verify rows."""
