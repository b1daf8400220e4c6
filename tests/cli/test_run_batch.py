"""`corral run-batch`: OpenAI batch files checked before anything is sent, run against a real local
engine (`--model`, the command as a real process) and against a server that is busy at first
(`--base-url`: retries honour Retry-After), results in file order."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from corral_cli.batch_file import BatchFileError, parse_batch, result_line, usage_of


def _line(custom_id: str, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_bad_file_names_every_bad_line() -> None:
    lines = [
        _line("a", model="m", prompt="hi"),
        "{not json",
        json.dumps({"custom_id": "", "url": "/v1/completions", "body": {}}),
        _line("a", model="m", prompt="again"),
        _line("b", url="/v1/images/generations", model="m"),
        json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}),
        _line("d", url="/v1/chat/completions", model="m", messages=[], stream=True),
        json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": "text"}),
        "",
        "[1]",
    ]
    with pytest.raises(BatchFileError) as e:
        parse_batch(lines)
    assert [p.split(":")[0] for p in e.value.problems] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7, 8, 10)]
    text = str(e.value)
    assert "8 invalid line(s); nothing was sent" in text
    assert "custom_id 'a' is already used on line 1" in text and "cannot stream" in text
    with pytest.raises(BatchFileError, match="holds no requests"):
        parse_batch(["", "  "])


def test_lines_and_results_have_openais_shapes() -> None:
    (line,) = parse_batch([_line("x", url="/v1/embeddings", model="m", input="hi")])
    assert (line.number, line.custom_id, line.url, line.body) == (
        1,
        "x",
        "/v1/embeddings",
        {"model": "m", "input": "hi"},
    )
    ok = json.loads(result_line(line, 200, {"usage": {"prompt_tokens": 3}}, "req-1"))
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "x" and ok["error"] is None
    assert ok["response"] == {
        "status_code": 200,
        "request_id": "req-1",
        "body": {"usage": {"prompt_tokens": 3}},
    }
    lost = json.loads(result_line(line, None, error=("timeout", "no answer")))
    assert lost["response"] is None and lost["error"] == {"code": "timeout", "message": "no answer"}
    assert usage_of({"usage": {"prompt_tokens": 4, "completion_tokens": 5}}) == (4, 5)
    assert usage_of({"usage": {"input_tokens": 4, "output_tokens": 5}}) == (4, 5)  # the Responses API's
    assert usage_of("text") == (0, 0)


def _run_batch(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "corral_cli.main", "run-batch", "--no-progress", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=600)


def test_a_local_engine_runs_the_batch_in_file_order(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """--model: the engine starts, answers each line (errors as the server gives them), stops."""
    model = str(tiny_model_dir)
    lines = [
        _line(
            "chat",
            url="/v1/chat/completions",
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
        ),
        _line("text", model=model, prompt="Once upon", max_tokens=5, temperature=0),
        _line("too-long", model=model, prompt="x", max_tokens=10**6),
        _line("empty", model=model, prompt=[], max_tokens=2),
        _line("same-text", model=model, prompt="Once upon", max_tokens=5, temperature=0),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "results" / "out.jsonl"
    done = _run_batch(
        "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", model, "--", "--dtype", "float32"
    )
    assert done.returncode == 1, done.stderr  # two lines failed
    results = [json.loads(text) for text in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat", "text", "too-long", "empty", "same-text"]
    codes = [r["response"]["status_code"] for r in results]
    assert codes == [200, 200, 400, 400, 200]
    chat, text, too_long, empty, same = (r["response"]["body"] for r in results)
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 4
    assert (
        text["choices"][0]["text"] == same["choices"][0]["text"] and text["usage"]["completion_tokens"] == 5
    )
    assert too_long["error"]["param"] == "max_tokens" and empty["error"]["message"]
    assert all(r["response"]["request_id"] for r in results)
    assert "5 requests in" in done.stderr and "3 succeeded, 2 failed (3 x 200, 2 x 400)" in done.stderr


class _BusyServer(ThreadingHTTPServer):
    """A server answering each body's first POST with 503 + Retry-After: 0 and the second with 200."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _BusyHandler)
        self.posts: Counter[str] = Counter()


class _BusyHandler(BaseHTTPRequestHandler):
    server: _BusyServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        key = body["prompt"]
        self.server.posts[key] += 1
        if self.server.posts[key] == 1:
            self._json(503, {"error": {"message": "busy"}}, {"retry-after": "0"})
        else:
            usage = {"prompt_tokens": 2, "completion_tokens": 3}
            self._json(
                200, {"choices": [{"text": key.upper()}], "usage": usage}, {"x-request-id": f"id-{key}"}
            )

    def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def busy() -> Iterator[_BusyServer]:
    server = _BusyServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: _BusyServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


def test_busy_answers_are_retried_and_results_keep_file_order(busy: _BusyServer) -> None:
    prompts = [f"p{i}" for i in range(12)]
    stdin = "\n".join(_line(f"id{i}", model="m", prompt=p) for i, p in enumerate(prompts))
    done = _run_batch(
        "-i", "-", "-o", "-", "--base-url", _url(busy) + "/v1", "--max-concurrency", "4", stdin=stdin
    )
    assert done.returncode == 0, done.stderr
    results = [json.loads(text) for text in done.stdout.splitlines()]
    assert [r["custom_id"] for r in results] == [f"id{i}" for i in range(12)]
    assert [r["response"]["body"]["choices"][0]["text"] for r in results] == [p.upper() for p in prompts]
    assert [r["response"]["request_id"] for r in results] == [f"id-{p}" for p in prompts]
    assert busy.posts == dict.fromkeys(prompts, 2)  # each once busy, then answered
    assert "12 succeeded, 0 failed (12 x 200); 24 prompt and 36 completion tokens" in done.stderr


def test_out_of_retries_the_busy_answer_is_the_result(busy: _BusyServer) -> None:
    done = _run_batch(
        "-i",
        "-",
        "-o",
        "-",
        "--base-url",
        _url(busy),
        "--max-retries",
        "0",
        stdin=_line("a", model="m", prompt="q"),
    )
    assert done.returncode == 1
    (result,) = [json.loads(text) for text in done.stdout.splitlines()]
    assert result["response"]["status_code"] == 503 and result["response"]["body"] == {
        "error": {"message": "busy"}
    }


def test_a_bad_file_sends_nothing(busy: _BusyServer) -> None:
    stdin = _line("a", model="m", prompt="q") + "\n{broken\n"
    done = _run_batch("-i", "-", "-o", "-", "--base-url", _url(busy), stdin=stdin)
    assert done.returncode == 2 and "line 2: not valid JSON" in done.stderr
    assert not busy.posts and not done.stdout


def test_an_unreachable_server_is_one_line(tmp_path: pathlib.Path) -> None:
    from corral_cli.listen import free_ports

    (port,) = free_ports("127.0.0.1", 1)
    done = _run_batch(
        "-i",
        "-",
        "-o",
        str(tmp_path / "o.jsonl"),
        "--base-url",
        f"http://127.0.0.1:{port}",
        stdin=_line("a", model="m", prompt="q"),
    )
    assert done.returncode == 1 and f"cannot reach http://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_engine_flags_need_a_local_engine() -> None:
    done = _run_batch(
        "-i", "-", "-o", "-", "--base-url", "http://127.0.0.1:9", "--", "--dtype", "float32", stdin=""
    )
    assert done.returncode == 2 and "engine flags (--dtype float32) are for --model" in done.stderr


def test_a_local_engine_serves_one_model() -> None:
    stdin = _line("a", model="m1", prompt="q") + "\n" + _line("b", model="m2", prompt="q")
    done = _run_batch("-i", "-", "-o", "-", "--model", "/nowhere", stdin=stdin)
    assert done.returncode == 2 and "the file names 2 models (m1, m2); --model serves one" in done.stderr
