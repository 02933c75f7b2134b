"""`dflash regenerate --server`: against a real `transformers serve` of the tiny target (started once for the
module), and against a small fake OpenAI-compatible server in a thread for the faults a real one rarely shows
on demand (5xx, timeouts, malformed answers, a row that answers late)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from conftest import REPO, SAMPLE_CHAT, TINY_TARGET, run_in_process, sample_rows, start_cli, write_jsonl
from dflash import serve_client
from dflash.regenerate_server import reasoning_field, row_seed

pytestmark = pytest.mark.slow


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json(res) -> dict:
    """The one JSON document `--json` prints (the output also has the log's lines)."""
    return json.loads(res.output[res.output.rindex('{"rows"'):].splitlines()[0])


def _errors(output: str) -> list[str]:
    return [x for x in output.splitlines() if x.startswith("error:")]


# -- a real server: transformers serve on the tiny target ----------------------------------------------------


def _serve_or_skip() -> None:
    try:
        import transformers.cli.serve  # noqa: F401  (transformers >= 5 has `transformers serve`)
        from transformers.utils.import_utils import is_serve_available
    except ImportError:
        pytest.skip("this transformers has no `transformers serve`")
    if not is_serve_available():
        pytest.skip("`transformers serve` needs transformers[serving] (fastapi, uvicorn, openai): "
                    "pip install -e '.[test]'")


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`transformers serve data/tiny-target` (fp32 on the CPU, as the in-process path runs it) on a free port:
    its base URL. The model name the tests pass is the folder (`--model`): transformers 5.17's /v1/models lists
    the hub cache, not the pinned model."""
    _serve_or_skip()
    port = _free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    cmd = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
           "sys.argv[0] = 'transformers'; sys.exit(main())", "serve", str(TINY_TARGET), "--device", "cpu",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, f"transformers serve exited: {Path(log.name).read_text()[-2000:]}"
            assert time.monotonic() - t0 < 120, "transformers serve did not start in 120 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _server_args(url: str, data: Path, out: Path, *more) -> list[str]:
    return ["regenerate", "--server", url, "--model", str(TINY_TARGET), "--target", str(TINY_TARGET),
            "--data", str(data), "--out", str(out), *map(str, more)]


def test_greedy_answers_through_transformers_serve_equal_the_in_process_ones(serve, tmp_path):
    """Text rows: the same file. Chat rows: the same answer, turn by turn, given the same conversation so far,
    except that transformers serve parses a Qwen-family answer with its response template (the reasoning
    between <think> tags into `reasoning_content`, <tool_call>s into `tool_calls`) and trims the whitespace
    around the content: the in-process path writes the decoded tokens as they are. The tiny target writes
    neither tag, so each served content is the in-process one stripped; token counts and finish reasons are
    the same."""
    chat = [json.loads(x) for x in SAMPLE_CHAT.read_text().splitlines()]
    rows = sample_rows(2, 4) + [chat[7]]  # chat[3] has a system prompt, chat[7] two assistant turns
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    served = tmp_path / "served.jsonl"
    res = run_in_process(_server_args(serve, data, served, "--max-new-tokens", 10, "--concurrency", 4, "--json"))
    assert res.exit_code == 0, res.output
    summary = _json(res)
    assert summary["rows"] == summary["written"] == 7 and summary["requests"] == 8
    got = _rows(served)
    assert [r["dflash_row"] for r in got] == list(range(7))
    # the in-process path on the same rows, and on the conversation the server's second turn answered
    first, second = (dict(chat[7], messages=got[6]["messages"][:k]) for k in (1, 3))
    data2 = write_jsonl(tmp_path / "d2.jsonl", rows + [first, second])
    local = tmp_path / "local.jsonl"
    res = run_in_process(["regenerate", "--target", str(TINY_TARGET), "--data", str(data2), "--out", str(local),
                          "--max-new-tokens", "10", "--batch-size", "4", "--device", "cpu", "--turns", "last"])
    assert res.exit_code == 0, res.output
    want = _rows(local)
    assert got[:2] == want[:2]  # text rows: byte for byte
    for g, w in zip(got[2:6], want[2:6]):
        assert g["messages"][:-1] == w["messages"][:-1] and g["source"] == w["source"]
        assert g["messages"][-1]["content"] == w["messages"][-1]["content"].strip()
        assert g["dflash_finish_reasons"] == w["dflash_finish_reasons"]
    turns = got[6]["messages"]
    assert [m["role"] for m in turns] == [m["role"] for m in chat[7]["messages"]]
    assert turns[0] == chat[7]["messages"][0] and turns[2] == chat[7]["messages"][2]
    assert turns[1]["content"] != chat[7]["messages"][1]["content"]  # both assistant turns regenerated
    assert len(got[6]["dflash_finish_reasons"]) == 2
    assert turns[1]["content"] == want[7]["messages"][-1]["content"].strip()
    assert turns[3]["content"] == want[8]["messages"][-1]["content"].strip()  # turn 2 given the served turn 1


def test_sigkill_then_the_same_command_requests_no_finished_row_again(serve, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(0, 12))  # row 7: two assistant turns
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    args = ("--max-new-tokens", 8, "--concurrency", 3)
    assert run_in_process(_server_args(serve, data, ref, *args)).exit_code == 0
    proc = start_cli(_server_args(serve, data, out, *args))
    ahead = Path(str(out) + ".ahead.jsonl")
    t0 = time.monotonic()
    while not (out.exists() and out.read_bytes().count(b"\n") >= 3):  # OUT's rows, each once
        assert proc.poll() is None and time.monotonic() - t0 < 120, "finished before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {r["dflash_row"] for p in (out, ahead) if p.exists() for r in _rows(p)}
    assert 3 <= len(finished) < 12
    asked = []
    post = serve_client.ServerClient._post

    async def spy(self, path, body, where):
        asked.append(int(where.split(":")[-1].split()[0]) - 1)  # "FILE:LINE": row LINE - 1
        return await post(self, path, body, where)

    monkeypatch.setattr(serve_client.ServerClient, "_post", spy)
    res = run_in_process(_server_args(serve, data, out, *args))
    assert res.exit_code == 0, res.output
    todo = set(range(12)) - finished
    assert set(asked) == todo and len(asked) == len(todo) + (7 in todo)  # every turn of each unfinished row, once
    assert out.read_bytes() == ref.read_bytes() and not ahead.exists()
    again = run_in_process(_server_args(serve, data, out, *args))
    assert again.exit_code == 0 and "nothing to do" in again.output


# -- a fake server, for the faults ---------------------------------------------------------------------------


class Fake:
    """An OpenAI-compatible server in a thread. Row i of the test data asks `q{i}`; the answer to turn k of it is
    `a{i}.{k}` (k: the assistant turns before it). `rule(row, body)` may return (status, payload or raw bytes) to
    answer otherwise, or a number of seconds to wait first; every request is kept in `seen`."""

    def __init__(self):
        self.seen: list[tuple[str, dict, dict]] = []
        self.models: list[str] | None = ["fake-model"]  # what GET /models lists (None: 404)
        self.rule = lambda row, body: None
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if fake.models is None:
                    return self._send(404, {"detail": "Not Found"})
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append((self.path, body, dict(self.headers)))
                self._send(*fake.answer(self.path, body))

            def _send(self, status, payload):
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:  # the client left (a timeout, a killed run)
                    pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def rows(self) -> list[int]:
        return [_row_of(body) for _, body, _ in self.seen]

    def answer(self, path: str, body: dict):
        row = _row_of(body)
        ruled = self.rule(row, body)
        if isinstance(ruled, (int, float)):
            self.release.wait(ruled)
            ruled = None
        if ruled is not None:
            return ruled
        if path.endswith("/completions") and "prompt" in body:
            return 200, {"choices": [{"index": 0, "text": " more", "finish_reason": "stop"}]}
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return 200, {"choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": f"a{row}.{turn}"}}],
                     "usage": {"completion_tokens": 3}}


def _row_of(body: dict) -> int:
    text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return int(text.split()[0][1:])


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(serve_client, "BACKOFF_S", 0.01)
    server = Fake()
    yield server
    server.release.set()
    server.http.shutdown()
    server.http.server_close()


def _chat_data(tmp_path: Path, n: int, turns: int = 1) -> Path:
    rows = []
    for i in range(n):
        msgs = []
        for k in range(turns):
            msgs += [{"role": "user", "content": f"q{i} turn {k}"}, {"role": "assistant", "content": "old"}]
        rows.append({"messages": msgs, "id": i})
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def _fake_args(fake: Fake, data: Path, out: Path, *more) -> list[str]:
    return ["regenerate", "--server", fake.url, "--data", str(data), "--out", str(out), *map(str, more)]


def test_the_server_down_at_start_is_one_line_naming_its_url(tmp_path):
    port = _free_port()
    out = tmp_path / "out.jsonl"
    res = run_in_process(["regenerate", "--server", f"http://127.0.0.1:{port}", "--data",
                          str(_chat_data(tmp_path, 2)), "--out", str(out)])
    assert res.exit_code == 1
    assert _errors(res.output) == [f"error: --server http://127.0.0.1:{port}/v1: cannot connect (Connection "
                                   f"refused); is the server running?"]
    assert not out.exists()


def test_the_model_is_the_servers_only_one_or_the_one_asked_for(fake, tmp_path):
    data = _chat_data(tmp_path, 1)
    fake.models = ["a", "b"]
    res = run_in_process(_fake_args(fake, data, tmp_path / "1.jsonl"))
    assert _errors(res.output) == [f"error: --server {fake.url} serves 2 models (a, b): pass --model"]
    assert run_in_process(_fake_args(fake, data, tmp_path / "2.jsonl", "--model", "b")).exit_code == 0
    res = run_in_process(_fake_args(fake, data, tmp_path / "3.jsonl", "--model", "c"))
    assert res.exit_code == 0 and f"warning: --model c: not among the models {fake.url} lists (a, b)" in res.output
    assert [b["model"] for _, b, _ in fake.seen] == ["b", "c"]
    fake.models = None
    res = run_in_process(_fake_args(fake, data, tmp_path / "4.jsonl"))
    assert _errors(res.output) == [f"error: --server {fake.url}: GET /models answered HTTP 404, not a list of models: "
                                   f"pass --model, and check that this is the API's base URL (e.g. http://HOST:8000/v1)"]
    assert run_in_process(_fake_args(fake, data, tmp_path / "4.jsonl", "--model", "d")).exit_code == 0


def test_every_assistant_turn_given_the_conversation_so_far_or_only_the_last(fake, tmp_path):
    data = _chat_data(tmp_path, 3, turns=2)
    out = tmp_path / "all.jsonl"
    assert run_in_process(_fake_args(fake, data, out, "--concurrency", 2)).exit_code == 0
    for i, row in enumerate(_rows(out)):
        assert [m["content"] for m in row["messages"]] == [f"q{i} turn 0", f"a{i}.0", f"q{i} turn 1", f"a{i}.1"]
        assert row["id"] == i and row["dflash_finish_reasons"] == ["stop", "stop"]
    second = [b["messages"] for _, b, _ in fake.seen if len(b["messages"]) == 3]
    assert sorted(m[1]["content"] for m in second) == ["a0.0", "a1.0", "a2.0"]  # turn 2 saw the new turn 1
    seeds = {(_row_of(b), len(b["messages"]) // 2): b["seed"] for _, b, _ in fake.seen}
    assert seeds == {(i, k): row_seed(0, i, k) for i in range(3) for k in range(2)}  # a seed per row and turn
    assert len(set(seeds.values())) == 6
    fake.seen.clear()
    last = tmp_path / "last.jsonl"
    assert run_in_process(_fake_args(fake, data, last, "--turns", "last")).exit_code == 0
    assert len(fake.seen) == 3
    for i, row in enumerate(_rows(last)):
        assert [m["content"] for m in row["messages"]] == [f"q{i} turn 0", "old", f"q{i} turn 1", f"a{i}.1"]


def test_system_prompt_tools_reasoning_and_tool_calls_are_kept(fake, tmp_path):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q0 add"},
                        {"role": "assistant", "content": "old"}], "tools": tools}
    call = [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    fake.rule = lambda r, body: (200, {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning": "think first", "tool_calls": call}}]})
    out = tmp_path / "out.jsonl"
    res = run_in_process(_fake_args(fake, write_jsonl(tmp_path / "d.jsonl", [row]), out))
    assert res.exit_code == 0, res.output
    (_, body, _), = fake.seen
    assert body["tools"] == tools and body["messages"] == row["messages"][:2]
    assert body["model"] == "fake-model" and body["max_tokens"] == 512 and body["temperature"] == 0.0
    assert body["seed"] == row_seed(0, 0, 0)
    got = _rows(out)[0]
    assert got["tools"] == tools and got["messages"][:2] == row["messages"][:2]
    assert got["messages"][2] == {"role": "assistant", "content": "", "reasoning_content": "think first",
                                  "tool_calls": call}
    assert got["dflash_finish_reasons"] == ["tool_calls"]


def test_the_reasoning_goes_in_the_field_the_chat_template_renders():
    class Tok:
        def __init__(self, template):
            self.chat_template = template

    assert reasoning_field(Tok("{{ message.reasoning_content }}")) == "reasoning_content"  # Qwen3
    assert reasoning_field(Tok("{% if 'thinking' in message %}{{ message['thinking'] }}{% endif %}")) == "thinking"
    assert reasoning_field(Tok("{{ message.content }}{{ enable_thinking }}")) == "reasoning_content"
    assert reasoning_field(Tok(None)) == "reasoning_content"


def test_answers_are_written_as_they_complete_and_the_output_is_in_row_order(fake, tmp_path):
    """Row 0 answers late: the others wait in OUT.ahead.jsonl, OUT stays empty; SIGKILL there, then the same
    command asks for row 0 only."""
    data, out = _chat_data(tmp_path, 12), tmp_path / "out.jsonl"
    ahead = Path(str(out) + ".ahead.jsonl")
    fake.rule = lambda row, body: 60 if row == 0 else None
    proc = start_cli(_fake_args(fake, data, out, "--concurrency", 4))
    t0 = time.monotonic()
    while not (ahead.exists() and ahead.read_bytes().count(b"\n") == 11):
        assert proc.poll() is None and time.monotonic() - t0 < 60, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.01)
    assert out.read_bytes() == b""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fake.rule = lambda row, body: None
    fake.seen.clear()
    res = run_in_process(_fake_args(fake, data, out, "--concurrency", 4, "--json"))
    assert res.exit_code == 0, res.output
    assert fake.rows() == [0] and not ahead.exists()
    assert [r["messages"][1]["content"] for r in _rows(out)] == [f"a{i}.0" for i in range(12)]
    assert _json(res)["written"] == 1


def test_sigterm_is_one_line_saying_where_it_stopped(fake, tmp_path):
    data, out = _chat_data(tmp_path, 6), tmp_path / "out.jsonl"
    fake.rule = lambda row, body: 60 if row == 0 else None
    proc = start_cli(_fake_args(fake, data, out, "--concurrency", 3))
    ahead, t0 = Path(str(out) + ".ahead.jsonl"), time.monotonic()
    while not (ahead.exists() and ahead.read_bytes().count(b"\n") == 5):  # all but row 0 answered
        assert proc.poll() is None and time.monotonic() - t0 < 60
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    assert proc.stderr.read().splitlines()[-1] == (f"stopped by SIGTERM with 5 of 6 rows finished (0 in {out}); run "
                                                   f"the same command again: it resumes")
    fake.rule = lambda row, body: None
    assert run_in_process(_fake_args(fake, data, out, "--concurrency", 3)).exit_code == 0
    assert fake.rows().count(0) == 2 and len(fake.seen) == 7
    assert [r["dflash_row"] for r in _rows(out)] == list(range(6))


def test_a_5xx_is_retried_then_one_line_and_every_finished_row_is_kept(fake, tmp_path):
    data, out = _chat_data(tmp_path, 8), tmp_path / "out.jsonl"
    fake.rule = lambda row, body: (503, {"detail": "overloaded"}) if row == 5 else None
    res = run_in_process(_fake_args(fake, data, out, "--concurrency", 2, "--retries", 2))
    assert res.exit_code == 1
    assert _errors(res.output)[0].startswith(f"error: --server {fake.url}: HTTP 503: overloaded ({data}:6), 3 tries; ")
    assert len(_errors(res.output)) == 1 and "run the same command again to resume" in res.output
    assert fake.rows().count(5) == 3
    finished = {r["dflash_row"] for p in (out, Path(str(out) + ".ahead.jsonl")) for r in _rows(p)}
    assert set(range(5)) <= finished and 5 not in finished
    fake.rule = lambda row, body: None
    fake.seen.clear()
    res = run_in_process(_fake_args(fake, data, out))
    assert res.exit_code == 0, res.output
    assert sorted(fake.rows()) == sorted(set(range(8)) - finished)
    assert [r["dflash_row"] for r in _rows(out)] == list(range(8))


def test_a_passing_5xx_and_a_timeout_are_retried(fake, tmp_path):
    data, out = _chat_data(tmp_path, 3), tmp_path / "out.jsonl"
    tries = []

    def rule(row, body):
        tries.append(row)
        if row == 1 and tries.count(1) == 1:
            return 502, b"<html>bad gateway</html>"
        if row == 2 and tries.count(2) == 1:
            return 2.0  # longer than --timeout
        return None

    fake.rule = rule
    res = run_in_process(_fake_args(fake, data, out, "--timeout", 0.5, "--json"))
    assert res.exit_code == 0, res.output
    assert _json(res)["retried"] == 2
    assert [r["messages"][1]["content"] for r in _rows(out)] == ["a0.0", "a1.0", "a2.0"]


def test_a_timeout_that_lasts_is_one_line(fake, tmp_path):
    data, out = _chat_data(tmp_path, 2), tmp_path / "out.jsonl"
    fake.rule = lambda row, body: 3.0 if row == 1 else None
    res = run_in_process(_fake_args(fake, data, out, "--timeout", 0.3, "--retries", 1))
    assert res.exit_code == 1
    assert _errors(res.output)[0].startswith(f"error: --server {fake.url}: no answer within --timeout 0.3 s "
                                             f"({data}:2), 2 tries; ")
    assert _rows(out)[0]["dflash_row"] == 0


@pytest.mark.parametrize("payload, what", [
    (b"not json", "not JSON: 'not json'"),
    ({"choices": []}, "no choices"),
    ({"choices": [{"index": 0, "message": {"role": "assistant", "content": 7}}]}, "message.content is a int, not text"),
])
def test_a_malformed_response_names_the_row(fake, tmp_path, payload, what):
    data, out = _chat_data(tmp_path, 3, turns=2), tmp_path / "out.jsonl"
    fake.rule = lambda row, body: (200, payload) if row == 2 and len(body["messages"]) == 3 else None
    res = run_in_process(_fake_args(fake, data, out, "--concurrency", 1))
    assert res.exit_code == 1
    assert _errors(res.output)[0].startswith(f"error: {data}:3 (assistant turn 2 of 2): malformed response from "
                                             f"--server {fake.url} ({what}); 2 rows are finished (2 in {out})")


def test_a_refused_request_names_the_row_and_a_length_cut_is_counted(fake, tmp_path):
    data, out = _chat_data(tmp_path, 3), tmp_path / "out.jsonl"
    fake.rule = lambda row, body: (400, {"detail": "prompt too long"}) if row == 2 else None
    res = run_in_process(_fake_args(fake, data, out))
    assert res.exit_code == 1
    assert _errors(res.output)[0].startswith(f"error: {data}:3: --server {fake.url} refused the request "
                                             f"(HTTP 400: prompt too long); ")
    cut = {"choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "a"}}]}
    fake.rule = lambda row, body: (200, cut) if row == 2 else None
    res = run_in_process(_fake_args(fake, data, out, "--json"))
    assert res.exit_code == 0, res.output
    assert _json(res)["cut_by_length"] == 1
    assert "1 of them cut at --max-new-tokens" in res.output
    assert _rows(out)[2]["dflash_finish_reasons"] == ["length"]
    other = run_in_process(_fake_args(fake, data, out, "--max-new-tokens", 64))
    assert other.exit_code == 1 and "other settings (max_new_tokens)" in other.output


def test_the_api_key_comes_from_the_environment_and_is_never_written(fake, tmp_path, monkeypatch):
    data, out = _chat_data(tmp_path, 2), tmp_path / "out.jsonl"
    missing = run_in_process(_fake_args(fake, data, out, "--api-key-env", "DFLASH_TEST_KEY"))
    assert missing.exit_code == 1
    assert _errors(missing.output) == ["error: --api-key-env DFLASH_TEST_KEY: that environment variable is not set"]
    monkeypatch.setenv("DFLASH_TEST_KEY", "sk-secret-123")
    fake.rule = lambda row, body: (503, {"detail": "busy"}) if row == 1 else None
    res = run_in_process(_fake_args(fake, data, out, "--api-key-env", "DFLASH_TEST_KEY", "--retries", 1))
    assert res.exit_code == 1
    assert {h["Authorization"] for _, _, h in fake.seen} == {"Bearer sk-secret-123"}
    fake.rule = lambda row, body: None
    res = run_in_process(_fake_args(fake, data, out, "--api-key-env", "DFLASH_TEST_KEY", "--json"))
    assert res.exit_code == 0, res.output
    written = "".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    assert "sk-secret" not in res.output + missing.output + written


def test_text_rows_need_the_tokenizer_and_continue_through_completions(fake, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "q0 " + "word " * 50}, {"prompt": "q1 hi", "completion": "x"}])
    out = tmp_path / "out.jsonl"
    res = run_in_process(_fake_args(fake, data, out))
    assert res.exit_code == 1
    assert _errors(res.output) == [f"error: {data}:1: a text row's prompt is its first --prompt-tokens tokens: "
                                   f"pass --target (the served model's folder or hub id) for its tokenizer"]
    res = run_in_process(_fake_args(fake, data, out, "--target", TINY_TARGET, "--prompt-tokens", 4))
    assert res.exit_code == 0, res.output
    text, completion = _rows(out)
    assert [p for p, _, _ in fake.seen] == ["/v1/completions"] * 2
    prompts = sorted(b["prompt"] for _, b, _ in fake.seen)
    assert prompts[1] == "q1 hi" and text["text"] == prompts[0] + " more" and len(text["text"]) < 30
    assert completion["prompt"] == "q1 hi" and completion["completion"] == " more"


def test_the_ordered_output_moves_rows_from_the_wait_and_resumes_from_both_files(tmp_path):
    from dflash.errors import DflashError
    from dflash.regenerate_server import OrderedOut

    out = tmp_path / "out.jsonl"
    line = lambda i: json.dumps({"dflash_row": i, "text": "a\u2028b"}, ensure_ascii=False) + "\n"  # noqa: E731
    w = OrderedOut(out, 600)
    w.open()
    for i in range(1, 300):
        w.add(i, line(i))
    assert out.read_text() == "" and w.ahead_path.read_text().count("\n") == 299
    w.add(0, line(0))  # all 300 move to OUT; the wait, emptied, is cut back
    assert out.read_text() == "".join(map(line, range(300))) and w.ahead_path.read_text() == ""
    for i in (302, 301):
        w.add(i, line(i))
    w.f.close(), w.g.close()  # a crash: no close(), and torn lines at both ends
    for p in (out, w.ahead_path):
        with p.open("a") as f:
            f.write('{"dflash_row": 3')
    again = OrderedOut(out, 600)
    again.resume()
    assert again.head == 300 and sorted(again.waiting) == [301, 302] and again.finished == 302
    assert out.read_text().endswith(line(299)) and again.ahead_path.read_text() == line(302) + line(301)
    again.ahead_path.write_text(line(301) + "junk\n")
    with pytest.raises(DflashError, match=r"out.jsonl.ahead.jsonl:2: not a row of this run"):
        OrderedOut(out, 600).resume()


def test_a_full_disk_is_one_line_and_the_same_command_resumes(fake, tmp_path, monkeypatch):
    import errno

    from dflash.regenerate_server import OrderedOut

    data, out = _chat_data(tmp_path, 5), tmp_path / "out.jsonl"
    add, calls = OrderedOut.add, []

    def full(self, row, line):
        calls.append(row)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        add(self, row, line)

    monkeypatch.setattr(OrderedOut, "add", full)
    res = run_in_process(_fake_args(fake, data, out, "--concurrency", 1))
    assert res.exit_code == 1
    assert _errors(res.output) == [f"error: {out}: no space left on the device; 2 rows are finished; free some "
                                   f"space and run the same command again: it resumes"]
    monkeypatch.setattr(OrderedOut, "add", add)
    fake.seen.clear()
    assert run_in_process(_fake_args(fake, data, out, "--concurrency", 1)).exit_code == 0
    assert fake.rows() == [2, 3, 4] and [r["dflash_row"] for r in _rows(out)] == list(range(5))
