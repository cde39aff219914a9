"""WSGI entry point (gunicorn governance.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
application = get_wsgi_application()
