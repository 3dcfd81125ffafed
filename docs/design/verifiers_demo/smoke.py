"""End-to-end: pipelinerl GenerateEndpoint (TorchEngine, SmolLM2) <- verifiers v1 TrainClient."""
import os
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import asyncio, json, logging, sys, threading, time
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch
torch.set_num_threads(1)
from pipelinerl.endpoint import GenerateEndpoint
from pipelinerl.engine.torch_engine import TorchEngine
import verifiers.v1 as vf

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
MODEL = os.path.expanduser("~/.cache/pipelinerl/models/HuggingFaceTB--SmolLM2-135M-Instruct")
ENV = sys.argv[1] if len(sys.argv) > 1 else "qa"


class RecordingEndpoint(GenerateEndpoint):
    """Test-only: remember each answered request under its X-Session-ID (= trace id)."""
    seen: dict = {}

    async def _generate(self, http):
        resp = await super()._generate(http)
        if resp.status == 200:
            body = json.loads(resp.body)
            self.seen.setdefault(http.headers.get("X-Session-ID"), []).append(body)
        else:
            print("ENDPOINT", resp.status, resp.body[:300])
        return resp


engine = TorchEngine.from_pretrained(MODEL, capacity=4, max_seq_len=1024, seed=0)
endpoint = RecordingEndpoint(model="smollm2", max_model_len=1024, vocab_size=49152,
                             default_max_tokens=64)
stop = threading.Event()

def actor_loop():
    while not stop.is_set():
        for r in endpoint.take(engine.capacity - engine.num_active()):
            engine.add_request(r)
        if not engine.num_active():
            stop.wait(0.002); continue
        for out in engine.step():
            endpoint.finish(out)

threading.Thread(target=actor_loop, daemon=True).start()

if ENV == "qa":
    raw = {"taskset": {"id": "qa_demo"},
           "agent": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}}
else:
    raw = {"taskset": {"id": "guess_demo", "n": 2},
           "player": {"harness": {"id": "pl_chat_harness"}, "runtime": {"type": "subprocess"}}}
env = vf.load_environment(vf.resolve_env_config(raw))
ctx = vf.ModelContext(
    model="smollm2",
    client=vf.TrainClientConfig(base_url=f"{endpoint.url}/v1", renderer_model_name=MODEL,
                                api_key_var="PIPELINERL_ENDPOINT_KEY"),
    sampling=vf.SamplingConfig(temperature=1.0, max_tokens=24),
)


async def main():
    tasks = list(env.taskset)
    attempts = 2
    sem = asyncio.Semaphore(4)
    t0 = time.time()
    async with env.serving():
        slots = [s for t in tasks[:2] for s in env.slots(t, attempts)]
        episodes = await asyncio.wait_for(
            asyncio.gather(*(env.run_slot(s, ctx, sem) for s in slots)), timeout=300)
    print(f"{len(episodes)} episodes in {time.time()-t0:.1f}s")
    for ep in episodes:
        print(f"episode ok={ep.ok} errors={[e.type+': '+e.message[:200] for e in ep.errors]} "
              f"task.key={ep.task.key[:10]} traces={len(ep.traces)}")
        for tr in ep.traces:
            print(f"  trace {tr.id[:8]} agent={tr.agent.name} trainable={tr.agent.trainable} ok={tr.ok} "
                  f"stop={tr.stop_condition} reward={tr.reward} rewards={ {k: (v.score, v.weight) if v else None for k, v in tr.rewards.items()} } "
                  f"metrics={tr.metrics} errors={[e.type+': '+e.message[:300] for e in tr.errors]}")
            for b in tr.branches:
                ids, mask, lps = b.token_ids, b.sampled_mask, b.logprobs
                print(f"    branch {b.index} trainable={b.trainable} tokens={len(ids)} sampled={sum(mask)} "
                      f"calls={[(c.finish_reason, c.usage.prompt_tokens if c.usage else None, c.usage.completion_tokens if c.usage else None) for c in b.calls]}")
                for n in b.nodes:
                    print(f"      node role={n.message.role} sampled={n.sampled} ntok={len(n.token_ids)} "
                          f"nmask={sum(n.mask)} nlp={len(n.logprobs)} text={str(n.message.content)[:60]!r}")
            # versions: match endpoint answers (by session id = trace id) to sampled nodes
            answers = endpoint.seen.get(tr.id, [])
            sampled = [n for n in tr.nodes if n.sampled]
            match = [a["choices"][0]["token_ids"] == [t for t, m in zip(n.token_ids, n.mask) if m]
                     for a, n in zip(answers, sampled)]
            lp_match = [max(abs(x - c["logprob"]) for x, c in zip(n.logprobs, a["choices"][0]["logprobs"]["content"])) if n.logprobs else None
                        for a, n in zip(answers, sampled)]
            print(f"    endpoint answers for this trace id: {len(answers)} request_ids={[a['request_id'] for a in answers]} "
                  f"token match={match} max|dlogprob|={lp_match} versions={[a['choices'][0]['versions'][:3] for a in answers]}")
    b = episodes[0].traces[0].branches[0]
    print("first branch token_ids[:40]:", b.token_ids[:40])
    print("record keys:", list(episodes[0].to_record().keys()))

try:
    asyncio.run(main())
finally:
    stop.set(); endpoint.close()
