# One image for every llmgw role; the command picks the role (`llmgw controlplane`, `llmgw agent`, ...).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/llmgw
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install . && useradd --system --uid 10001 --home /var/lib/llmgw --create-home llmgw
USER llmgw
WORKDIR /var/lib/llmgw
ENTRYPOINT ["llmgw"]
CMD ["--help"]
