import re
from pathlib import Path

from setuptools import find_packages, setup

# The version is written once, in trec_pipelines/_version.py (read, not imported:
# importing the package needs torch and torchrec).
_VERSION_FILE = Path(__file__).parent / "trec_pipelines" / "_version.py"
_match = re.search(r'^__version__ = "([^"]+)"$', _VERSION_FILE.read_text(), re.MULTILINE)
if _match is None:
    raise RuntimeError(f"no __version__ line in {_VERSION_FILE}")

setup(
    name="trec_pipelines",
    version=_match.group(1),
    description="Drop-in replacements for TorchRec's training pipelines, on CPU and GPU.",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=find_packages(include=["trec_pipelines", "trec_pipelines.*"]),
    package_data={"trec_pipelines": ["py.typed"]},
    # torch, torchrec and fbgemm-gpu are the user's to install: CPU users get
    # the pinned stack from requirements-cpu.txt, GPU users bring their own.
    install_requires=[],
)
