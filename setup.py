from setuptools import find_packages, setup

setup(
    name="trec_pipelines",
    version="0.1.0",
    description="Drop-in replacements for TorchRec's training pipelines, on CPU and GPU.",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=find_packages(include=["trec_pipelines", "trec_pipelines.*"]),
    package_data={"trec_pipelines": ["py.typed"]},
    # torch, torchrec and fbgemm-gpu are the user's to install: CPU users get
    # the pinned stack from requirements-cpu.txt, GPU users bring their own.
    install_requires=[],
)
