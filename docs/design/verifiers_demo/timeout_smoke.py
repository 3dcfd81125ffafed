import os
os.environ.setdefault("OMP_NUM_THREADS", "1"); os.environ["HF_HUB_OFFLINE"] = "1"
import asyncio, logging, sys, threading, time
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch; torch.set_num_threads(1)
from pipelinerl.endpoint import GenerateEndpoint
from pipelinerl.engine.torch_engine import TorchEngine
import verifiers.v1 as vf
logging.basicConfig(level=logging.ERROR)
MODEL = os.path.expanduser("~/.cache/pipelinerl/models/HuggingFaceTB--SmolLM2-135M-Instruct")
engine = TorchEngine.from_pretrained(MODEL, capacity=4, max_seq_len=512, seed=0)
ep = GenerateEndpoint(model="smollm2", max_model_len=512, vocab_size=49152, default_max_tokens=16)
stop = threading.Event()
def loop():
    while not stop.is_set():
        for r in ep.take(engine.capacity - engine.num_active()): engine.add_request(r)
        if not engine.num_active(): stop.wait(0.002); continue
        for out in engine.step(): ep.finish(out)
th = threading.Thread(target=loop, daemon=True); th.start()
client = vf.TrainClientConfig(base_url=f"{ep.url}/v1", renderer_model_name=MODEL, api_key_var="X_KEY")
ctx = vf.ModelContext(model="smollm2", client=client, sampling=vf.SamplingConfig(max_tokens=300, temperature=1.0))
async def main():
    for label, raw in [
        ("agent.timeout.rollout=1", {"taskset": {"id": "qa_demo"}, "agent": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}, "timeout": {"rollout": 1}}}),
        ("env.timeout.episode=1", {"taskset": {"id": "qa_demo"}, "timeout": {"episode": 1}, "agent": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}}),
    ]:
        env = vf.load_environment(vf.resolve_env_config(raw))
        task = next(iter(env.taskset))
        t0 = time.time()
        async with env.serving():
            e = await env.run_episode(task, ctx)
        t = e.traces[0] if e.traces else None
        print(label, f"{time.time()-t0:.1f}s ep.ok", e.ok, "ep.is_timeout", e.is_timeout, "ep.errors", [(x.type, x.message[:90]) for x in e.errors], "traces", len(e.traces))
        if t: print("   trace ok", t.ok, "is_timeout", t.is_timeout, "stop", t.stop_condition, "rewards", t.rewards, "turns", t.num_turns, "calls", [(c.error.type if c.error else None) for c in t.calls])
        while engine.num_active(): await asyncio.sleep(0.1)   # the abandoned engine request runs to its end
asyncio.run(main()); stop.set(); th.join(); ep.close()
