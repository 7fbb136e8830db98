"""Where models and files come from: target loading, the embedded defaults, stores, fingerprints, cache."""
