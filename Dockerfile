# Server image: stepdoctor with the server extra. The server never needs torch.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY backend ./backend
COPY frontend ./frontend
COPY migrations ./migrations
RUN pip install --no-cache-dir ".[server]"
ENV STEPDOCTOR_DATA_DIR=/data
EXPOSE 8000
CMD ["stepdoctor", "serve", "--host", "0.0.0.0", "--port", "8000"]
