# Two commands on a fresh machine with only Python and pip:
#   make run    # the whole service on embedded defaults (SQLite, no external services)
#   make test   # the test suite (SQLite, or PostgreSQL when DATABASE_URL is set)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
HOST   ?= 127.0.0.1:8000

.PHONY: run test lint check bench bench-http fuzz install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# The web server in the foreground, a Celery worker and beat beside it (governance/celery.py:
# Redis when REDIS_URL is set, else an embedded broker in var/celery). Both are stopped
# when the server exits, however it exits.
run: $(STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_demo --address $(HOST)
	$(PY) manage.py audit_checkpoint
	@mkdir -p var/celery
	@echo "Serving on http://$(HOST)/ (with a Celery worker and beat)"
	@trap 'kill $$worker $$beat 2>/dev/null; wait' EXIT; trap 'exit 129' HUP; trap 'exit 130' INT TERM; \
	setsid $(VENV)/bin/celery -A governance worker --pool=solo --loglevel=INFO & worker=$$!; \
	setsid $(VENV)/bin/celery -A governance beat --loglevel=INFO --schedule=var/celery/beat-schedule & \
	beat=$$!; \
	$(PY) manage.py runserver --insecure --noreload $(HOST)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check: $(STAMP)
	$(PY) manage.py check
	$(PY) manage.py makemigrations --check --dry-run

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks.authorize

# /authorize over HTTP (gunicorn, 2 workers) beside a constant-JSON DRF view, at 1, 4 and
# 16 keep-alive callers; same data set as `make bench` (PostgreSQL, gov_bench by default).
bench-http: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	DATABASE_URL=$${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/gov_bench} \
		$(PY) -m benchmarks.http_authorize

# Schemathesis against the live schema as agent A, agent B and an admin, on a fresh
# PostgreSQL database (governance_fuzz, dropped afterwards; FUZZ_POSTGRES names the server).
fuzz: $(STAMP)
	$(PY) -m pip install --quiet -e '.[fuzz]'
	$(PY) -m fuzz.schemathesis_run

clean:
	rm -rf $(VENV) db.sqlite3 var
