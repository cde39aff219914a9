FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY governance ./governance
COPY sandbox_runner ./sandbox_runner
COPY benchmarks ./benchmarks
COPY templates ./templates
COPY manage.py ./
RUN pip install --no-cache-dir . gunicorn
USER 1000:1000
CMD ["gunicorn", "governance.wsgi", "--bind", "0.0.0.0:8000", "--workers", "2"]
