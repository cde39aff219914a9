from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from governance import selectors


def home(request: HttpRequest) -> HttpResponse:
    return render(request, "home.html", {"summary": selectors.matrix_summary()})


def healthz(request: HttpRequest) -> JsonResponse:
    connection.ensure_connection()
    return JsonResponse({"status": "ok"})
