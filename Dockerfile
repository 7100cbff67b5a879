# One image for every smoltorrent role (node, worker, flower, beat); the
# compose file picks the role with the command. Built from the source tree:
#   docker build -t smoltorrent .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# .dockerignore keeps .venv, .git, tests and bench out of the context.
COPY . .
RUN pip install ".[coordinator]" \
    # A fixed uid, so bind mounts (./checkpoints) can be chowned to it on the host.
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/smoltorrent \
       --create-home smoltorrent \
    # Mount points owned by that user: empty named volumes inherit this ownership.
    && mkdir -p /data /checkpoints /var/lib/smoltorrent/beat \
    && chown -R smoltorrent:smoltorrent /data /checkpoints /var/lib/smoltorrent \
    && rm -rf /src

USER smoltorrent
WORKDIR /var/lib/smoltorrent
EXPOSE 7411 5555
ENTRYPOINT ["smoltorrent"]
CMD ["--help"]
