"""The tools example (examples/tools_mcp.yaml): a question the model cannot answer without
calling a tool. Each of 400 made-up product names has a 4-digit stock code that only the
MCP server below knows; the task asks for a product's code, and a completion succeeds when
its last turn (after the tool's reply) names the code.

Run as a program, this file is the MCP server (stdio, the official SDK's MCPServer):
`python examples/tools_lookup.py`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re

from pipelinerl.tasks.base import Problem, Score

SYLLABLES = ["ka", "lo", "mi", "ter", "van", "zu", "bri", "dex", "nor", "pel", "qua", "sil"]
PRODUCTS = sorted({f"{a}{b}{c}".capitalize()
                   for a in SYLLABLES for b in SYLLABLES for c in ("x", "on", "a")})[:400]


def stock_code(product: str) -> str:
    """The code only the server knows: four digits from the name's hash."""
    return f"{int(hashlib.sha256(product.encode()).hexdigest(), 16) % 10000:04d}"


class StockCodes:
    """`examples.tools_lookup:StockCodes` (task.name): what is the stock code of a product?"""

    name = "stock_codes"

    def sample_problem(self, rng: random.Random) -> Problem:
        product = rng.choice(PRODUCTS)
        return Problem(f"stock:{product}",
                       f"What is the stock code of the product {product}? Use the tool, "
                       "then answer with the code.", stock_code(product))

    def tool_demonstration(self, problem: Problem, rng: random.Random,
                           error_prob: float) -> list[str]:
        """The model's turns for the warm start (`warmstart.given_model`): a call, then the
        answer read from the reply. Noisy, so RL has room: with `error_prob` the call is skipped
        and a code guessed; with `error_prob / 2` the reply is read wrong."""
        product = problem.problem_id.removeprefix("stock:")
        if rng.random() < error_prob:
            return [f"The stock code of {product} is {rng.randrange(10000):04d}."]
        call = json.dumps({"name": "stock_lookup", "arguments": {"product": product}})
        code = problem.answer
        if rng.random() < error_prob / 2:
            code = f"{(int(code) + rng.randrange(1, 10000)) % 10000:04d}"
        return [f"<tool_call>\n{call}\n</tool_call>", f"The stock code of {product} is {code}."]

    def score(self, problem: Problem, transcript: str) -> Score:
        # What follows the last tool reply: the model's answer, not the tool's text.
        answer = transcript.rsplit("</tool_response>", 1)[-1]
        ok = re.search(rf"\b{problem.answer}\b", answer) is not None
        return Score(float(ok), ok)


if __name__ == "__main__":
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("stock-codes")

    @server.tool()
    def stock_lookup(product: str) -> str:
        """The stock code of a product, by its name."""
        name = product.strip().capitalize()
        return stock_code(name) if name in PRODUCTS else f"no product named {product!r}"

    server.run()
