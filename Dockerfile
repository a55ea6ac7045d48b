# CERAR-Pythia training image: CUDA PyTorch, the project's requirements, torchrun as entrypoint.
#   docker build -t cerar-pythia .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/cerar-pythia/outputs cerar-pythia \
#       --nproc_per_node=gpu train/main.py model=pythia-70m aggregator=cerar c=16
#   docker run --gpus all --ipc=host --entrypoint python cerar-pythia scripts/checks/gpu_check.py   # the GPU check
# Multi-node: add --network host and torchrun's rendezvous flags (see README, "Training on a GPU cluster").
#
# The base carries torch 2.13.0, the version the test suite runs (requirements-cpu.txt pins its CPU build),
# with CUDA 12.6 (drivers >= 525 through CUDA's minor-version compatibility; Hopper and older). For
# Blackwell GPUs (sm_100, sm_120) build with --build-arg BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime.
ARG BASE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/workspace/.cache/huggingface \
    CERAR_PYTHIA_CACHE=/workspace/.cache/cerar-pythia

WORKDIR /workspace/cerar-pythia

# The base image's CUDA build of torch stays in place and must be the tested version; its exact version
# becomes a pip constraint, so a dependency that wanted another torch fails the build instead of
# replacing it (a CPU wheel, say).
COPY requirements.txt ./
RUN python -c "import torch; v = torch.__version__.split('+')[0]; assert v == '2.13.0', f'base image has torch {v}: the tests ran 2.13.0'; assert torch.version.cuda, 'base image torch has no CUDA'; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && cat /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt -r requirements.txt \
    && python -c "import torch; assert torch.version.cuda, 'torch lost its CUDA build'"

COPY . .
RUN pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node=gpu", "train/main.py"]
