"""fuzz.serial_ast: the fuzzer's threads never run ast.parse at the same time
(the CPython 3.11 bug it works around is in fuzz/serial_ast.py)."""

from __future__ import annotations

import ast
import threading
import time

from fuzz import serial_ast


def test_parses_run_one_at_a_time_and_still_parse():
    inside = 0
    most = 0
    count = threading.Lock()

    def slow_parse(source: str, *args, **kwargs):
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
        time.sleep(0.005)  # long enough for the other threads to arrive
        with count:
            inside -= 1
        return ast.Module(body=[], type_ignores=[]) if source == "" else None

    parse = serial_ast.serialized(slow_parse)
    start = threading.Barrier(8)

    def worker():
        start.wait()
        for _ in range(5):
            parse("")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == 1
    assert inside == 0


def test_install_wraps_ast_parse_once_and_keeps_its_results(monkeypatch):
    monkeypatch.setattr(ast, "parse", ast.parse)  # restored after the test
    serial_ast.install()
    wrapped = ast.parse
    serial_ast.install()
    assert ast.parse is wrapped  # not wrapped twice
    assert getattr(wrapped, "__serialized__", False)
    tree = ast.parse("lambda x: x + 1", mode="eval")
    assert isinstance(tree.body, ast.Lambda)
