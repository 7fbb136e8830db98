"""A job's rows on storage: inputs, output parts, the write task, the summary (Ray Data task code, no torch)."""
