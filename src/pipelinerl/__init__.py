"""pipelinerl: fast on-policy RL for language models with in-flight weight updates."""

__version__ = "0.1.0"
