"""Grant-matrix governance for agents with tool access.

The Celery app (governance/celery.py) is not imported here: the tasks are bound
to it explicitly (governance/tasks.py), `celery -A governance` finds it as the
`governance.celery` submodule, and a process that never sends a task (the
sandbox runner's CLI, manage.py commands) does not pay for importing Celery.
"""
