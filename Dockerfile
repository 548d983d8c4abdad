# Server image: the stepdoctor wheel with the server extra, installed as users install it (never the
# source tree, never editable). tests/test_wheel_install.py builds the wheel from the same COPY lines
# with the README's command and serves the dashboard from it. The server never needs torch.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY backend ./backend
COPY frontend ./frontend
COPY migrations ./migrations
RUN python -m pip wheel --no-cache-dir --no-deps -w /dist .

FROM python:3.11-slim
COPY --from=wheel /dist /dist
# Installed as root into the image; run as an unprivileged user with a fixed numeric id (so
# Kubernetes' runAsNonRoot can check it) that owns only the data directory.
RUN pip install --no-cache-dir "$(echo /dist/stepdoctor-*.whl)[server]" \
 && rm -rf /dist \
 && groupadd --system --gid 10001 stepdoctor \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home --shell /usr/sbin/nologin stepdoctor \
 && mkdir -p /data \
 && chown 10001:10001 /data
ENV STEPDOCTOR_DATA_DIR=/data
WORKDIR /data
USER 10001:10001
EXPOSE 8000
CMD ["stepdoctor", "serve", "--host", "0.0.0.0", "--port", "8000"]
