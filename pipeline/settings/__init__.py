"""What a job is told: the config schema, the sampling settings and their per-row overrides."""
