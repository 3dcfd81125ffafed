import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
import verifiers.v1 as vf
for raw in [
    {"taskset": {"id": "qa_demo"}, "agent": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}},
    {"taskset": {"id": "guess_demo", "n": 2}, "player": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}},
]:
    cfg = vf.resolve_env_config(raw)
    env = vf.load_environment(cfg)
    print(type(env).__name__, type(cfg).__name__, cfg.env_id, type(env.taskset).__name__)
    for t in env.taskset.take(3):
        print("  ", t.data.idx, t.key[:10], repr(t.data.prompt)[:60], t.data.model_dump(exclude_defaults=True, exclude={"prompt"}))
    print("   harnesses:", {k: (type(h).__name__, h.NEEDS_CONTAINER, h.EXECUTES_CODE) for k, h in env._harnesses.items()})
    print("   runtimes:", {k: s.runtime.type for k, s in env._agent_specs.items()})
