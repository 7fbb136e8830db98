"""A job's parts on Ray besides the engine: the device check, the node's N-gram store, metrics, remote errors."""
