"""llama.cpp's own test models (test-llama-archs -o DIR): one random GGUF per architecture, dense
and MoE, written by the pinned tree's model saver. Their MoE layers have two experts (top-2); the
tests widen them (pyllamapool.run.testmodel.widen_experts) so that a pool has something to evict."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "build" / "cpu" / "bin" / "test-llama-archs"
BUILD_HINT = "test-llama-archs is built by `python build.py --target cpu`"
#: the models' tensors are drawn from this seed: the same files every run
SEED = 7
#: the file names the tool gives its MoE models
MOE_SUFFIX = "-moe.gguf"


def generate(out: Path, arch: str | None = None, timeout_s: float = 600) -> Path:
    """Write the models of one architecture (an exact name), or of all of them, into out."""
    if not TOOL.exists():
        raise FileNotFoundError(BUILD_HINT)
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(TOOL), "-s", str(SEED), "-o", str(out)] + (["-a", arch] if arch else [])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return out


def expert_count(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.expert_count")
    return int(field.contents()) if field is not None else 0


def moe_models(out: Path) -> dict[str, Path]:
    """Architecture -> its MoE model among those the tool wrote into out: the `-moe` files, and
    any other whose GGUF says it has more than one expert."""
    found = {}
    for path in sorted(out.glob("*.gguf")):
        if path.name.endswith(MOE_SUFFIX):
            found[path.name[: -len(MOE_SUFFIX)]] = path
        elif expert_count(path) > 1:
            found[path.stem] = path
    return found


def tool_stamp() -> str:
    """Changes whenever the tool is rebuilt: cached models are tied to the binary that wrote them."""
    stat = TOOL.stat()
    return f"{stat.st_mtime_ns}-{stat.st_size}"
