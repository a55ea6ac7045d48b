# CERAR-Pythia training image: CUDA PyTorch, the project's requirements, torchrun as entrypoint.
#   docker build -t cerar-pythia .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/cerar-pythia/outputs cerar-pythia \
#       --nproc_per_node=gpu train/main.py model=pythia-70m aggregator=cerar c=16
# Multi-node: add --network host and torchrun's rendezvous flags (see README, "Training on a GPU cluster").
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/workspace/.cache/huggingface \
    CERAR_PYTHIA_CACHE=/workspace/.cache/cerar-pythia

WORKDIR /workspace/cerar-pythia

# The base image's CUDA build of torch stays in place: its exact version becomes a pip constraint, so a
# dependency that wanted another torch fails the build instead of replacing it (a CPU wheel, say).
COPY requirements.txt ./
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && cat /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt -r requirements.txt \
    && python -c "import torch; assert torch.version.cuda, 'torch lost its CUDA build'"

COPY . .
RUN pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node=gpu", "train/main.py"]
