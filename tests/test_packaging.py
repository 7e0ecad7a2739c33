"""The folder ``kernels/`` is the package ``agspec_gpu.kernels``, never a top-level ``kernels``.

``kernels`` on PyPI is Hugging Face's kernel hub, a dependency of transformers (5.2x):
transformers imports it (``from kernels import CUDAProperties, ...``) when a model class is
built. A regular package ``kernels/`` at the repository root shadowed it for every run that
puts the root on ``sys.path`` (``python -m pytest``, ``python -c``, a script at the root),
and building a Llama then failed with an ``ImportError``. The folder has no ``__init__.py``;
``agspec_gpu/kernels`` links to it, so a checkout imports it as ``agspec_gpu.kernels``
(a namespace package) whether or not it is installed, and the wheel holds it there.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "kernels").glob("*.py"))

_CHILD = """
import importlib, importlib.util, sys
spec = importlib.util.find_spec("kernels")
# None, a namespace portion (no origin) or an installed package: never the checkout's folder
print("kernels:", None if spec is None else spec.origin)
for name in sys.argv[1:]:
    importlib.import_module("agspec_gpu.kernels." + name)
from transformers import LlamaConfig, LlamaForCausalLM  # imports the hub's kernels
LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
print("imported", len(sys.argv) - 1)
"""


def test_kernels_folder_is_not_a_top_level_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "agspec_gpu" / "kernels").resolve() == (ROOT / "kernels").resolve()
    assert len(MODULES) >= 10 and "suffix_match" in MODULES


def test_imports_from_the_repository_root_and_elsewhere(tmp_path):
    """``python -c`` puts the working directory first on ``sys.path``."""
    for cwd in (ROOT, tmp_path):
        proc = subprocess.run([sys.executable, "-c", _CHILD, *MODULES], cwd=cwd,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        origin = proc.stdout.splitlines()[0].split(": ", 1)[1]
        assert origin == "None" or not origin.startswith(str(ROOT / "kernels")), origin
        assert proc.stdout.splitlines()[-1] == f"imported {len(MODULES)}"


def test_wheel_holds_every_kernel_under_agspec_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", str(ROOT), "-w", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"agspec_gpu/kernels/{m}.py" for m in MODULES} <= names
    assert not any(n.startswith("kernels/") for n in names)
