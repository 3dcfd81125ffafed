"""The actor's machinery, shared with the evaluator and the environments: admission (how many
groups may be in flight), scoring in worker processes, the engine's sampling settings, the
token-level generate endpoint, and the decode-clock queue of answers due."""
