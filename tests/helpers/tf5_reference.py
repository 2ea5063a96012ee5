"""A second virtual environment with transformers 5, the reference for architectures transformers 4.57.1 lacks.

The test extras pin transformers 4.57.1 (mindformers 1.9 requires it); ``glm4_moe_lite`` (GLM-4.7-Flash) first
appears in transformers 5.1. So the tests run transformers' own code for those models in a separate venv with
:data:`PINS`, created once under the user cache dir (keyed by the pins and the Python version, guarded by a file
lock so parallel sessions do not race) and driven through ``tf5_reference_script.py`` as a subprocess.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
from filelock import FileLock
from platformdirs import user_cache_dir

PINS = ("torch==2.13.0", "transformers==5.23.0", "safetensors")
SCRIPT = Path(__file__).with_name("tf5_reference_script.py")
#: Creating the venv downloads and installs about 1 GB; this bounds a hung index.
INSTALL_TIMEOUT_S = 1800
READY = "mindmoe-ready.json"


class ReferenceUnavailable(RuntimeError):
    """The transformers-5 environment could not be created (typically: no network to the package index)."""


def venv_dir() -> Path:
    key = hashlib.sha256(json.dumps([PINS, sys.version_info[:2]]).encode()).hexdigest()[:12]
    return Path(user_cache_dir("mindmoe")) / "tf5-reference" / f"{'-'.join(p.split('==')[-1] for p in PINS[:2])}-{key}"


def ensure_venv() -> Path:
    """The venv's Python, creating the venv first if no complete one exists (a half-built one is redone)."""
    root = venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        python = root / "bin" / "python"
        if (root / READY).is_file() and python.is_file():
            return python
        shutil.rmtree(root, ignore_errors=True)
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(root)
        except (OSError, subprocess.CalledProcessError) as err:
            shutil.rmtree(root, ignore_errors=True)
            raise ReferenceUnavailable(f"python -m venv {root} failed: {err}") from None
        command = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PINS]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            shutil.rmtree(root, ignore_errors=True)
            raise ReferenceUnavailable(f"pip install {' '.join(PINS)} took over {INSTALL_TIMEOUT_S} s") from None
        if done.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            raise ReferenceUnavailable(
                f"pip install {' '.join(PINS)} failed (exit {done.returncode}); is the package index reachable?\n"
                + done.stderr[-3000:]
            )
        (root / READY).write_text(json.dumps({"pins": PINS}) + "\n", encoding="utf-8")
        return python


class Reference:
    """Runs transformers 5 in the reference venv: build a random model from a config, reload a directory."""

    def __init__(self, python: Path):
        self.python = python

    def _run(self, spec: dict, work: Path) -> dict:
        work.mkdir(parents=True, exist_ok=True)
        spec_file = work / "spec.json"
        spec_file.write_text(json.dumps(spec), encoding="utf-8")
        # Only the reference venv's packages: no PYTHONPATH from the test session, one thread like the tests.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        done = subprocess.run(
            [str(self.python), str(SCRIPT), str(spec_file)], capture_output=True, text=True, env=env, timeout=600
        )
        if done.returncode != 0:
            raise RuntimeError(f"the transformers 5 reference failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads((work / "result.json").read_text(encoding="utf-8"))

    def build(self, config: dict, seed: int, save_dir: Path, ids: np.ndarray, capture=()) -> dict:
        """A random fp32 ``AutoModelForCausalLM.from_config(config)`` (O(1) weights from ``seed``) saved with
        ``save_pretrained`` to ``save_dir``; returns ``logits`` for ``ids`` [B, S] (all positions), the
        ``state`` file (its ``state_dict`` as safetensors) and ``config`` (``config.to_dict()``). ``capture``:
        module-name suffixes whose call arguments come back as ``captured`` (``tf5_reference_script.py``)."""
        spec = dict(mode="build", config=config, seed=seed, save_dir=str(save_dir), ids=ids.tolist())
        return self._load_outputs(self._run(dict(spec, capture=list(capture)), Path(str(save_dir) + ".work")))

    def reload(self, directory: Path, ids: np.ndarray) -> dict:
        """``AutoModelForCausalLM.from_pretrained(directory)`` in fp32: logits for ``ids``, state, config."""
        return self._load_outputs(
            self._run(dict(mode="reload", load_dir=str(directory), ids=ids.tolist()), Path(str(directory) + ".work"))
        )

    def config(self, values: dict, work: Path) -> dict:
        """``AutoConfig.for_model(**values).to_dict()``: what transformers 5 writes for ``values``."""
        return self._run(dict(mode="config", config=values), work)["config"]

    @staticmethod
    def _load_outputs(result: dict) -> dict:
        from safetensors.numpy import load_file

        result["logits"] = np.load(result["logits"])
        result["state"] = load_file(result["state"])
        if "captured" in result:
            with np.load(result["captured"]) as captured:
                result["captured"] = dict(captured)
        return result
