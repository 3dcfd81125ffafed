"""How failures surface: (a) endpoint 400 (max_tokens too big), (b) malformed response, (c) 503,
(d) deadline via asyncio.wait_for / env timeout."""
import os
os.environ.setdefault("OMP_NUM_THREADS", "1"); os.environ["HF_HUB_OFFLINE"] = "1"
import asyncio, json, logging, sys, threading
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch; torch.set_num_threads(1)
from aiohttp import web
from pipelinerl.endpoint import GenerateEndpoint
from pipelinerl.engine.torch_engine import TorchEngine
import verifiers.v1 as vf
logging.basicConfig(level=logging.ERROR)
MODEL = os.path.expanduser("~/.cache/pipelinerl/models/HuggingFaceTB--SmolLM2-135M-Instruct")
MODE = {"value": "ok"}

class Faulty(GenerateEndpoint):
    async def _generate(self, http):
        if MODE["value"] == "503":
            return web.json_response({"error": {"message": "full", "code": 503}}, status=503)
        resp = await super()._generate(http)
        if MODE["value"] == "malformed" and resp.status == 200:
            body = json.loads(resp.body)
            body["choices"][0]["logprobs"]["content"][0]["logprob"] = -9999.0
            return web.json_response(body)
        return resp

engine = TorchEngine.from_pretrained(MODEL, capacity=4, max_seq_len=512, seed=0)
ep = Faulty(model="smollm2", max_model_len=512, vocab_size=49152, default_max_tokens=16)
stop = threading.Event()
def loop():
    while not stop.is_set():
        for r in ep.take(engine.capacity - engine.num_active()): engine.add_request(r)
        if not engine.num_active(): stop.wait(0.002); continue
        for out in engine.step(): ep.finish(out)
threading.Thread(target=loop, daemon=True).start()

raw = {"taskset": {"id": "qa_demo"}, "agent": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}}
env = vf.load_environment(vf.resolve_env_config(raw))
client = vf.TrainClientConfig(base_url=f"{ep.url}/v1", renderer_model_name=MODEL, api_key_var="X_KEY")

async def one(label, sampling, timeout=120):
    task = next(iter(env.taskset))
    ctx = vf.ModelContext(model="smollm2", client=client, sampling=sampling)
    async with env.serving():
        try:
            e = await asyncio.wait_for(env.run_episode(task, ctx), timeout)
        except TimeoutError:
            print(label, "-> asyncio.wait_for TimeoutError (episode cancelled)"); return
    t = e.traces[0] if e.traces else None
    print(label, "-> episode.ok", e.ok, "ep.errors", [x.type for x in e.errors])
    if t:
        print("   trace.ok", t.ok, "stop", t.stop_condition, "rewards", t.rewards,
              "\n   errors", [(x.type, x.status_code, x.message[:160]) for x in t.errors],
              "\n   calls", [(c.finish_reason, c.error and (c.error.type, c.error.status_code, c.error.message[:100])) for c in t.calls])

async def main():
    await one("max_tokens>room", vf.SamplingConfig(max_tokens=2000))
    MODE["value"] = "malformed"; await one("malformed", vf.SamplingConfig(max_tokens=8))
    MODE["value"] = "503"; await one("503", vf.SamplingConfig(max_tokens=8))
    MODE["value"] = "ok"; await one("deadline", vf.SamplingConfig(max_tokens=400), timeout=0.5)
try:
    asyncio.run(main())
finally:
    stop.set(); ep.close()
