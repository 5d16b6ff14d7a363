# kvobserve: one image for every role of the stack (collect, aggregate, simulate, tap, status, ...).
#   docker build -t kvobserve:local .
#   docker run --rm kvobserve:local --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Dependencies first, in their own layer: a code change then does not reinstall them.
COPY pyproject.toml README.md ./
COPY kvobserve/__init__.py kvobserve/__init__.py
RUN pip install ".[kubernetes]" && pip uninstall -y kvobserve
COPY kvobserve ./kvobserve
RUN pip install --no-deps . && rm -rf /src

# Never run as root: the collector only needs outbound connections and one listening port.
RUN useradd --system --uid 10001 --create-home --home-dir /home/kvobserve --shell /usr/sbin/nologin kvobserve
USER kvobserve
WORKDIR /home/kvobserve

# 9477 aggregator HTTP, 9478 collector local /metrics (simulated engines use their own ports).
EXPOSE 9477 9478
ENTRYPOINT ["kvobserve"]
CMD ["--help"]
