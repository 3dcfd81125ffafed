"""A single-turn verifiers environment on a local dataset, written as verifiers users write
them (verifiers 0.4.0, `verifiers.v1`): a Taskset whose tasks are the rows of a JSONL file read
with Hugging Face `datasets`, and a reward method on the Task.

Train it with `task.name: verifiers:vf_qa` from this folder (vf_qa.yaml): pipelinerl imports the
module by its id, as verifiers does.
"""

import re

import verifiers.v1 as vf
from datasets import load_dataset


class QAData(vf.TaskData):
    answer: str


def final_answer(reply: str) -> str:
    """The reply's last word or number, lower-cased without punctuation: small models
    answer in sentences ("The answer is 7.")."""
    words = re.findall(r"[A-Za-z0-9]+(?:\.[0-9]+)?", reply)
    return words[-1].lower() if words else ""


class QATask(vf.Task[QAData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: QAData, trace: vf.Trace) -> float:
        return float(final_answer(trace.last_reply) == task.answer.strip().lower())


class QAConfig(vf.TasksetConfig):
    path: str = "data/sums.jsonl"
    question: str = "question"
    answer: str = "answer"
    instruction: str = "Answer with just the answer."


class QATaskset(vf.Taskset[QATask, QAConfig]):
    def load(self):
        rows = load_dataset("json", data_files=self.config.path, split="train")
        for i, row in enumerate(rows):
            yield QATask(QAData(id=f"qa-{i}",
                                prompt=f"{row[self.config.question]} {self.config.instruction}",
                                answer=str(row[self.config.answer])),
                         self.config.task)


__all__ = ["QATaskset"]
