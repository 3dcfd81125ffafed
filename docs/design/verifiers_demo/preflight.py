"""Refuse, at start, envs that need network, containers, sandboxes or host-executed programs."""
import inspect, sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields

OURS = "pl_chat_harness"           # the in-process harness id (top-level module)

def normalize(raw: dict) -> dict:
    """Pin every role (declared or defaulted) to our harness + subprocess runtime unless set."""
    cls = vf.env_config_type((raw.get("taskset") or {}).get("id", ""), raw.get("id", ""))
    raw = dict(raw)
    for name, field in cls.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            role = dict(raw.get(name) or {})
            declared = field.default.harness.id if field.default.harness else None
            if "harness" not in role and declared in (None, "null"):
                role["harness"] = {"id": OURS}
            role.setdefault("runtime", {"type": "subprocess"})
            raw[name] = role
    return raw

def problems(env: vf.Env, sample_tasks: int = 64) -> list[str]:
    out = []
    cfg = env.config
    for name, spec in agent_config_fields(cfg).items():
        h = env._harnesses[name]
        if h.config.id != OURS:
            out.append(f"role {name!r}: harness {h.config.id!r} runs a program (uv/network/container)")
        if spec.runtime.type != "subprocess":
            out.append(f"role {name!r}: runtime {spec.runtime.type!r} (container/sandbox)")
        if spec.client is not None:
            out.append(f"role {name!r}: its own model endpoint {spec.client.base_url}")
        if spec.model is not None:
            out.append(f"role {name!r}: pinned model {spec.model!r}")
    if env._requires_tunnel({}):
        out.append("interception needs a tunnel")
    ts, task_cls = env.taskset, type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        out.append(f"{task_cls.__name__}.NEEDS_CONTAINER")
    if task_cls.toolsets(ts.config.task) or type(ts).toolsets(ts.config):
        out.append("MCP tool servers (Toolset: uv-built packages in processes, or URLs)")
    if ts.config.task.judges:
        out.append(f"LLM judges {[j.id for j in ts.config.task.judges]} (external endpoint)")
    for hook in ("setup", "finalize", "stage_verifier", "validate"):
        if getattr(task_cls, hook) is not getattr(vf.Task, hook):
            out.append(f"{task_cls.__name__}.{hook} overridden (runs against a runtime)")
    probe = next(iter(ts), None)
    if probe is not None:
        for kind in ("reward", "metric", "stop"):
            for fn in probe.hooks(kind):
                p = inspect.signature(fn).parameters.get("runtime")
                if p is not None and p.default is inspect.Parameter.empty:
                    out.append(f"{kind} {fn.__name__} needs a runtime")
    if ts.bounded or True:
        for i, t in zip(range(sample_tasks), ts):
            d = t.data
            if d.image or d.network_allow != ["*"] or d.network_block or d.skills or d.artifacts \
                    or d.resources.gpu or d.agent_user:
                out.append(f"task {d.idx}: image/network policy/skills/artifacts/resources/agent_user")
                break
    return out

if __name__ == "__main__":
    for raw in [
        {"taskset": {"id": "qa_demo"}},
        {"taskset": {"id": "guess_demo"}},
        {"id": "best-of-n", "taskset": {"id": "qa_demo"}},
        {"id": "user-sim", "taskset": {"id": "qa_demo"}},
        {"taskset": {"id": "qa_demo"}, "agent": {"harness": {"id": "bash"}}},
        {"taskset": {"id": "qa_demo"}, "agent": {"runtime": {"type": "docker"}}},
        {"taskset": {"id": "qa_demo", "task": {"judges": [{"id": "reference"}]}}},
        {"id": "agentic-judge", "taskset": {"id": "qa_demo"}},
    ]:
        try:
            env = vf.load_environment(vf.resolve_env_config(normalize(raw)))
            print(raw, "->", problems(env) or "OK")
        except Exception as e:
            print(raw, "-> construction error:", type(e).__name__, str(e)[:150])
