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

# requirements.txt keeps torch as a range, so the base image's CUDA build of torch stays in place.
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

COPY . .
RUN pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node=gpu", "train/main.py"]
