# neuron_tp on AWS Trainium / Inferentia: the Neuron PyTorch training deep-learning container
# (torch 2.9, torch-xla 2.9, torch-neuronx, neuronx-cc, Neuron runtime, EFA libraries, Python 3.12)
# plus this package. Pinned tag, never `latest`: see docs/deployment.md to move to a newer SDK.
# Build:  docker build -t neuron-tp:0.1.0 .
FROM public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.27.1-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MALLOC_ARENA_MAX=64

WORKDIR /opt/neuron_tp

# Freeze everything the base image already has (torch, torch-xla, torch-neuronx, neuronx-cc,
# numpy, ...) as pip constraints: the installs below may only ADD missing packages, never
# upgrade, downgrade or reinstall what the Neuron image ships (the build fails instead).
# The light runtime dependencies are pinned; pip leaves them alone if already satisfied, and
# if the image's own transformers were older than our range the build stops here, by design.
RUN python3 -m pip list --format=freeze > /opt/neuron_tp/image-constraints.txt \
 && python3 -m pip install -c /opt/neuron_tp/image-constraints.txt \
        "safetensors>=0.4,<1" "transformers>=4.51,<6" "fastapi>=0.110,<1" "uvicorn>=0.29,<1" \
        "prometheus_client>=0.26,<1"

# The package itself, without dependency resolution (torch & co. come from the image).
# Installed in place (-e) so that paths relative to the checkout, such as the default
# training corpus in data/, resolve inside /opt/neuron_tp as they do in the repo.
COPY pyproject.toml README.md ./
COPY neuron_tp/ ./neuron_tp/
COPY scripts/ ./scripts/
COPY data/ ./data/
RUN python3 -m pip install --no-deps -e . \
 && python3 -c "import torch, torch_xla, safetensors, neuron_tp; print('neuron_tp', neuron_tp.__file__, 'torch', torch.__version__)"

# Non-root default user. The Neuron runtime works unprivileged: the device plugin passes
# /dev/neuron* into the pod, and the Neuron driver's default udev rule makes them 0666 (on
# hosts hardened to 0660 + group "neuron", add that gid to the pod's supplementalGroups).
# EFA needs an unlimited memlock limit, which the container runtime grants on the EKS
# accelerated AMIs; a non-root process cannot raise it itself. If a cluster lacks either,
# run the pod as root via its securityContext (runAsUser: 0) rather than changing this image.
RUN useradd --no-log-init --uid 10001 --create-home --shell /bin/bash neuron \
 && mkdir -p /var/tmp/neuron-compile-cache \
 && chown 10001:10001 /var/tmp/neuron-compile-cache
USER 10001

# Batch training/inference workloads: Kubernetes judges them by exit code, not a health probe.
#checkov:skip=CKV_DOCKER_2:batch jobs (torchrun training / generation) have no service to health-check; Kubernetes tracks the process exit code
# The base image's ENTRYPOINT (hostname fix-up for SageMaker) is replaced on purpose.
ENTRYPOINT ["torchrun", "scripts/train.py"]
CMD ["--help"]
