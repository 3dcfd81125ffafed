"""Single-turn QA taskset on a local list (v1 style)."""
import verifiers.v1 as vf

ROWS = [("What is 2+3?", "5"), ("What is 7*6?", "42"), ("Capital of France?", "Paris")]


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:   # refuse a 2nd model call
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, task: QAData, trace: vf.Trace) -> float:
        return float(task.answer.lower() in trace.last_reply.lower())

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class QAConfig(vf.TasksetConfig):
    system_prompt_text: str = "Answer briefly."


class QATaskset(vf.Taskset[QATask, QAConfig]):
    def load(self):
        for i, (q, a) in enumerate(ROWS):
            yield QATask(QAData(id=f"qa-{i}", prompt=q, answer=a,
                                system_prompt=self.config.system_prompt_text),
                         self.config.task)


__all__ = ["QATaskset"]
