"""pipelinerl: fast on-policy RL for language models with in-flight weight updates."""

from pipelinerl import _moved

__version__ = "0.1.0"

_moved.install()
