FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY governance ./governance
COPY sandbox_runner ./sandbox_runner
COPY benchmarks ./benchmarks
COPY templates ./templates
COPY manage.py ./
RUN pip install --no-cache-dir . gunicorn
# Static files, collected at build (the base settings need no secrets for it) and served
# by the app under governance.settings_production (WhiteNoise).
ENV STATIC_ROOT=/app/static
RUN DJANGO_SETTINGS_MODULE=governance.settings python manage.py collectstatic --noinput -v 0
# The audit checkpoints' volume: a new named volume copies this directory's owner, so
# the app's user can write its checkpoints there.
RUN mkdir /checkpoints && chown 1000:1000 /checkpoints
USER 1000:1000
ENV DJANGO_SETTINGS_MODULE=governance.settings_production
CMD ["gunicorn", "governance.wsgi", "--bind", "0.0.0.0:8000", "--workers", "2"]
