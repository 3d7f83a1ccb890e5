# maxtrain image. The target picks the accelerator build of jax:
#   docker build --target cuda -t maxtrain:cuda .    # NVIDIA GPUs (jax[cuda13])
#   docker build --target tpu  -t maxtrain:tpu  .    # Cloud TPU VMs (jax[tpu], libtpu)
#   docker build --target cpu  -t maxtrain:cpu  .    # CPU only (what CI tests)
# Run: docker run --rm [--gpus all | --privileged --net=host] maxtrain:<target> CONFIG.yml key=value ...
# The repository is installed in editable mode because configs/ and recipes/ are read from the
# checkout (maxtrain/config/loading.py resolves them relative to the package).

FROM python:3.12-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/maxtrain
COPY pyproject.toml README.md ./
COPY maxtrain ./maxtrain
COPY configs ./configs
COPY recipes ./recipes
COPY tools ./tools
ENTRYPOINT ["python", "-m", "maxtrain.train"]
CMD ["configs/base.yml"]

FROM base AS cpu
RUN pip install -e .

FROM base AS cuda
RUN pip install -e ".[cuda]"

FROM base AS tpu
RUN pip install -e ".[tpu]"
