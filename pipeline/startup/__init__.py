"""What a run does before generation: preflight checks, output modes, the Ray connection, the dry run."""
