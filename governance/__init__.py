"""Grant-matrix governance for agents with tool access."""

# The Celery-Django convention: the app is loaded whenever Django is, so
# @shared_task binds to it and `celery -A governance` finds it.
from governance.celery import app as celery_app

__all__ = ["celery_app"]
