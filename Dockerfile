# The image of every towerflow pod on Kubernetes (k8s/): Ray head and workers, the RayJob
# submitter and the MLflow server. Built on the official Ray image of the Ray version that
# pyproject.toml pins, so the cluster's Ray and the client's agree (tests/k8s checks them).
#
#   docker build -t REGISTRY/towerflow:ray2.60.0 .
#   docker build --build-arg RAY_IMAGE_VARIANT=py311-gpu -t REGISTRY/towerflow:ray2.60.0-gpu .
#
# RAY_IMAGE_VARIANT is the rayproject/ray tag's suffix: py311 (CPU) or py311-gpu (CUDA).
ARG RAY_VERSION=2.60.0
ARG RAY_IMAGE_VARIANT=py311
FROM rayproject/ray:${RAY_VERSION}-${RAY_IMAGE_VARIANT}

ARG RAY_IMAGE_VARIANT

# The base image's user: "ray", uid 1000, group "users" (gid 100). Its conda environment
# (/home/ray/anaconda3) belongs to it, so pip installs without root.
USER 1000:100

# towerflow itself, from a scratch copy that is removed again: only the installed package stays.
# Its dependencies come from pyproject.toml; Ray is already the pinned one and stays. The MLflow
# server's extras are added at the same MLflow version: basic-auth (mlflow[auth]) and the
# PostgreSQL driver. The GPU variant adds TensorFlow's CUDA libraries at the same TensorFlow version.
COPY --chown=1000:100 pyproject.toml README.md /tmp/towerflow-src/
COPY --chown=1000:100 platform /tmp/towerflow-src/platform
RUN pip install --no-cache-dir /tmp/towerflow-src \
 && MLFLOW_VERSION="$(python -c 'import importlib.metadata as m; print(m.version("mlflow"))')" \
 && pip install --no-cache-dir "mlflow[auth]==${MLFLOW_VERSION}" "psycopg2-binary>=2.9,<3" \
 && case "${RAY_IMAGE_VARIANT}" in \
      *gpu*) TF_VERSION="$(python -c 'import importlib.metadata as m; print(m.version("tensorflow"))')" \
             && pip install --no-cache-dir "tensorflow[and-cuda]==${TF_VERSION}" ;; \
    esac \
 && rm -rf /tmp/towerflow-src

# The working directory of every Ray pod (k8s/ sets workingDir to it): the job specs and the model
# zoo by the relative names the specs use (pipelines/..., models.lenet:build), and data/, where the
# data volume is mounted.
WORKDIR /home/ray/towerflow
COPY --chown=1000:100 models ./models
COPY --chown=1000:100 pipelines ./pipelines

# The pods' root filesystems are read-only (k8s/): caches and config that libraries would write
# under $HOME go to /tmp, an emptyDir there. Python writes no bytecode next to the sources.
ENV PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    KERAS_HOME=/tmp/keras \
    XDG_CACHE_HOME=/tmp/cache \
    XDG_CONFIG_HOME=/tmp/config
