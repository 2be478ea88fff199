# mlx-voicechat on Linux, MLX's CPU backend (mlx[cpu]); no GPU. For trying the
# server and for CI-like use: the released 11B checkpoint is far from real
# time on a CPU (real time wants Apple silicon, which a container cannot use).
#
#   docker build -t mlx-voicechat .
#   docker run --rm -p 8080:8080 -v "$PWD/models:/models:ro" mlx-voicechat
#
# The checkpoint is not in the image: mount a directory holding it at /models
# (README, "Getting a checkpoint"). Another checkpoint or more flags: append a
# whole command, e.g.
#   docker run ... mlx-voicechat mlx-voicechat serve --host 0.0.0.0 \
#       --model /models/other --api-key KEY --max-sessions 2
# The server binds 0.0.0.0 inside the container so the published port reaches
# it; anything that can reach that port can talk to it, so add --api-key (and
# read SECURITY.md) before publishing it beyond the host.
FROM python:3.11-slim

# g++: MLX's CPU backend compiles each fused kernel with the system C++
# compiler the first time it meets it (README, "Compile policy"). ffmpeg:
# the host's audio reader decodes OGG/Opus, M4A/AAC and WebM uploads with it
# (WAV, FLAC and MP3 need nothing).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml setup.py README.md LICENSE mlx_voicechat_plugin-hosts.pth ./
COPY mlx_voicechat_plugin ./mlx_voicechat_plugin
RUN pip install --no-cache-dir ".[server]"

# MLX's compiled-kernel cache (<tmp>/mlx/...); mount a volume here to keep
# compiled kernels across container restarts (a cold cache compiles during
# the start-up warm-up, before /health reports ready).
ENV TMPDIR=/var/cache/mlx-voicechat
RUN mkdir -p /var/cache/mlx-voicechat /models
VOLUME ["/models"]

EXPOSE 8080
# Loading the checkpoint and the warm-up come before /health answers 200.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"
CMD ["mlx-voicechat", "serve", "--host", "0.0.0.0", "--port", "8080", "--model", "/models/NemotronLabs-VoiceChat-11B-4bit"]
