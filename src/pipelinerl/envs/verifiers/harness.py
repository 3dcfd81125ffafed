"""pipelinerl's harness for verifiers environments: in process, tool-less, one chat call a turn.

Every harness verifiers ships runs its agent as a program (a PEP 723 script that `uv` builds,
fetching its dependencies: network) or in a container. A harness may instead run its loop in
the rollout's own process, as long as each model call goes to the rollout's interception
endpoint (verifiers' `Harness.launch` contract); that endpoint renders the conversation to
token ids and calls the actor's generate endpoint through `TrainClient`, and records the turn in
the trace. Tool calls (MCP tool servers) are not supported: environments that declare them are
refused at load (`pipelinerl.envs.verifiers.loading`).

verifiers imports a harness by id as a top-level module: `loading` registers this one as
`HARNESS_ID`.
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt is a message of its own
    SUPPORTS_RESUME = True  # a later turn relaunches on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: Any, data: Any, tool_interception_url: str | None = None
                     ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        # No client timeout: the rollout's own deadline (timeout.rollout) cancels this call.
        async with httpx.AsyncClient(timeout=None) as http:
            reply = await http.post(f"{endpoint}/chat/completions",
                                    headers={"Authorization": f"Bearer {secret}"},
                                    json={"model": ctx.model, "messages": messages})
        # A refused turn (a @stop or a token limit) is a 4xx with the stop condition already
        # on the trace: the program ends, as an agent does when told to stop.
        ok = reply.status_code == 200
        return vf.ProgramResult(exit_code=0 if ok else 1, stdout="", stderr="" if ok else reply.text)


__all__ = ["ChatHarness", "ChatHarnessConfig"]
