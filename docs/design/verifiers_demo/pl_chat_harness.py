"""An in-process, tool-less chat harness: one model call per segment, made over HTTP to the
rollout's interception endpoint (the harness contract), no uv, no subprocess, no network."""
import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True   # system prompt as its own message
    SUPPORTS_RESUME = True         # default resume(): relaunch on the accreted conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=None) as http:
            r = await http.post(f"{endpoint}/chat/completions",
                                headers={"Authorization": f"Bearer {secret}"},
                                json={"model": ctx.model, "messages": messages})
        if r.status_code != 200:   # a @stop / limit refusal is a 400 with stop_condition set
            return vf.ProgramResult(exit_code=1, stdout="", stderr=r.text)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness", "ChatHarnessConfig"]
