# Server image: stepdoctor with the server extra. The server never needs torch.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY backend ./backend
COPY frontend ./frontend
COPY migrations ./migrations
# Installed as root into the image; run as an unprivileged user with a fixed numeric id (so
# Kubernetes' runAsNonRoot can check it) that owns only the data directory.
RUN pip install --no-cache-dir ".[server]" \
 && groupadd --system --gid 10001 stepdoctor \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home --shell /usr/sbin/nologin stepdoctor \
 && mkdir -p /data \
 && chown 10001:10001 /data
ENV STEPDOCTOR_DATA_DIR=/data
USER 10001:10001
EXPOSE 8000
CMD ["stepdoctor", "serve", "--host", "0.0.0.0", "--port", "8000"]
