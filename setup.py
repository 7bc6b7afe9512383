"""Install opacus_dp: ``pip install .`` (add ``[examples]`` / ``[test]`` / ``[hf]`` extras as needed)."""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(here, "opacus_dp", "version.py")) as f:
    exec(f.read(), version)

with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="opacus_dp",
    version=version["__version__"],
    description="Differentially private training (DP-SGD) for PyTorch: per-sample gradients, "
    "clipping, noise and privacy accounting on one device, DataParallel and DDP.",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["opacus_dp", "opacus_dp.*"]),
    package_data={"opacus_dp.optim.philox": ["kernel.c"]},  # compiled on first use (docs/noise.md)
    install_requires=["torch>=2.2", "numpy>=1.23", "scipy>=1.9"],
    extras_require={
        "examples": ["torchvision>=0.17", "tqdm>=4.60", "scikit-learn>=1.2"],
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "opacus==1.6.0", "dp-accounting>=0.4"],
        # Hugging Face models (GPT-2's Conv1D), the Trainer (accelerate), LoRA adapters and timm models
        "hf": ["transformers>=4.40", "accelerate>=1.0", "peft>=0.10", "timm>=1.0"],
        # PyTorch Lightning: opacus_dp.integrations.lightning and its tests
        "lightning": ["lightning>=2.1"],
    },
    entry_points={"console_scripts": ["opacus-dp-calculator=opacus_dp.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
