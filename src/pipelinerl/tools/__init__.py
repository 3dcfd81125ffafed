"""Tools the model calls in its own chat format: Python functions and MCP servers, turned on
for any task by the config's `tools` section (docs/tools.md).

- `specs`: a tool's name, description and argument schema; a call.
- `formats`: calls parsed as the model's family writes them (hermes, llama3, a user's parser).
- `chat`: the specs and the replies through the model's chat template.
- `mcp_servers`, `host`: the role's MCP servers (sessions per rollout) and functions, each
  call under its deadline.
- `replies`: a tool-using rollout's turns answered (the multi-turn protocol's reply pool).
- `record`: every call and reply recorded; recorded replies replayed.
- `task`: `equip`, a task and codec made tool-using.
"""

from pipelinerl.tools.specs import ToolCall, ToolSpec

__all__ = ["ToolCall", "ToolSpec"]
