"""HttpJudge against a real HTTP server on 127.0.0.1: timeout, malformed replies, dropped connections, concurrency."""
import collections
import http.server
import json
import threading
import time

import pytest

from jaxrlvr.rewards import judge as judge_lib
from jaxrlvr.rewards.judge_prompts import JudgeRequest

_TIMEOUT_S = 0.3
_SLOW_S = 1.0  # well past the timeout
_HOLD_WAIT_S = 2.0


class _Server:
  """A fake OpenAI-compatible server; what it does depends on a keyword in the graded answer."""

  def __init__(self):
    self.hits = collections.Counter()
    self.in_flight = 0
    self.max_in_flight = 0
    self.holding = 0
    self.max_holding = 0
    self.bodies = []
    self.auth = []
    self.lock = threading.Condition()
    state = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):  # keep pytest output clean
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = body["messages"][-1]["content"]
        key = next((k for k in ("SLOW", "MALFORMED", "BADJSON", "DROP", "ERR500", "NOMODEL", "HOLD") if k in user),
                   "OK")
        with state.lock:
          state.hits[key] += 1
          hit = state.hits[key]
          state.bodies.append(body)
          state.auth.append(self.headers.get("Authorization"))
          state.in_flight += 1
          state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
          if key == "SLOW":
            time.sleep(_SLOW_S)
          if key == "HOLD":
            # Counted only while held, and released before the reply is sent: the client cannot start its next
            # request until this reply arrives, so the count cannot race with the client. A held request waits
            # (up to _HOLD_WAIT_S) for a second one, so a bounded client reaches its bound however loaded the
            # machine is, and one that is not bounded shows more.
            with state.lock:
              state.holding += 1
              state.max_holding = max(state.max_holding, state.holding)
              state.lock.notify_all()
              state.lock.wait_for(lambda: state.holding >= 2, timeout=_HOLD_WAIT_S)
            time.sleep(0.05)
            with state.lock:
              state.holding -= 1
          if key == "DROP" and hit == 1:
            self.close_connection = True  # hang up without a status line: RemoteDisconnected on the client
            return
          if key == "ERR500" and hit == 1:
            self._send(500, b'{"error": "overloaded"}')
          elif key == "NOMODEL":
            self._send(404, b'{"error": "model not found"}')
          elif key == "BADJSON":
            self._send(200, b"<html>gateway says hi</html>")
          else:
            content = "It reads fine to me." if key == "MALFORMED" else "Step checks out.\nSCORE: 4"
            reply = {"choices": [{"message": {"role": "assistant", "content": content}}],
                     "usage": {"prompt_tokens": 321, "completion_tokens": 7}}
            self._send(200, json.dumps(reply).encode())
        except (BrokenPipeError, ConnectionResetError):
          pass  # the client gave up on a slow reply
        finally:
          with state.lock:
            state.in_flight -= 1

      def _send(self, code, payload):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    self.thread.start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def server():
  s = _Server()
  yield s
  s.close()


def _judge(server, **kwargs):
  kwargs = {"timeout_s": _TIMEOUT_S, "max_retries": 1, "max_concurrency": 4, "backoff_s": 0.01, **kwargs}
  return judge_lib.HttpJudge(server.url, "judge-model", **kwargs)


def _request(answer):
  return JudgeRequest(question="What is 2+3?", reference="2+3=5", answer=answer)


def test_good_reply_is_scored_and_the_request_is_openai_shaped(server):
  [result] = _judge(server).score([_request("5")])
  assert result.score == 0.75  # SCORE: 4 -> (4 - 1) / 4
  assert result.error is None and result.attempts == 1
  assert result.tokens_sent == 321  # from the server's usage.prompt_tokens
  body = server.bodies[0]
  assert body["model"] == "judge-model" and body["temperature"] == 0.0
  assert [m["role"] for m in body["messages"]] == ["system", "user"]


def test_slow_reply_times_out_and_fails_after_retries(server):
  t0 = time.monotonic()
  [result] = _judge(server).score([_request("SLOW")])
  elapsed = time.monotonic() - t0
  assert result.score is None and not result.parse_failed
  assert "timeout" in result.error
  assert result.attempts == 2 and server.hits["SLOW"] == 2  # first try + max_retries=1
  # Two tries of ~0.3 s each plus 0.01 s backoff; far below two full slow replies (2 s).
  assert 2 * _TIMEOUT_S <= elapsed < 2 * _SLOW_S


def test_malformed_reply_is_a_parse_failure_without_retry(server):
  no_verdict, not_json = _judge(server).score([_request("MALFORMED"), _request("BADJSON")])
  assert no_verdict.score is None and no_verdict.parse_failed and no_verdict.error is None
  assert no_verdict.text == "It reads fine to me." and no_verdict.attempts == 1
  assert not_json.score is None and "bad response" in not_json.error and not_json.attempts == 1


def test_dropped_connection_and_5xx_are_retried_and_then_succeed(server):
  dropped, overloaded = _judge(server).score([_request("DROP"), _request("ERR500")])
  for result in (dropped, overloaded):
    assert result.score == 0.75 and result.error is None and result.attempts == 2
  assert server.hits["DROP"] == 2 and server.hits["ERR500"] == 2
  # Without a retry the same hang-up is a failed request: the first try really was dropped.
  server.hits.clear()
  [no_retry] = _judge(server, max_retries=0).score([_request("DROP")])
  assert no_retry.score is None and "RemoteDisconnected" in no_retry.error


def test_concurrency_is_bounded_and_order_is_kept(server):
  requests = [_request(f"HOLD {i}") for i in range(6)] + [_request("MALFORMED")]
  # A timeout far above the hold: a try that timed out would be retried while the server still held it, and the
  # server would count more requests than the client has in flight.
  results = _judge(server, max_concurrency=2, timeout_s=30.0).score(requests)
  assert [r.score for r in results] == [0.75] * 6 + [None]
  assert [r.attempts for r in results] == [1] * 7
  assert server.max_holding == 2


def test_unknown_model_raises_instead_of_dropping_every_rollout(server):
  with pytest.raises(judge_lib.JudgeError, match="404"):
    _judge(server).score([_request("NOMODEL")])


def test_connection_refused_is_a_failed_result(server):
  server.close()
  [result] = _judge(server, max_retries=2).score([_request("5")])
  assert result.score is None and "connection" in result.error and result.attempts == 3


def test_bad_arguments_name_the_value():
  with pytest.raises(ValueError, match="max_concurrency=0"):
    judge_lib.HttpJudge("http://127.0.0.1:1", "m", max_concurrency=0)
  with pytest.raises(ValueError, match="base_url='127.0.0.1:8000'"):
    judge_lib.HttpJudge("127.0.0.1:8000", "m")
  assert judge_lib.chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
  assert judge_lib.chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"


def test_judge_from_config(server, monkeypatch):
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = ml_collections.ConfigDict({"kind": "http", "base_url": server.url + "/v1", "model_name": "judge-model",
                                   "timeout_s": 5.0, "max_retries": 0, "max_concurrency": 2, "max_tokens": 64,
                                   "api_key_env": "JAXRLVR_TEST_JUDGE_KEY"})
  with pytest.raises(judge_lib.JudgeError, match="JAXRLVR_TEST_JUDGE_KEY"):
    judge_lib.judge_from_config(cfg)
  monkeypatch.setenv("JAXRLVR_TEST_JUDGE_KEY", "secret")
  judge = judge_lib.judge_from_config(cfg)
  assert isinstance(judge, judge_lib.HttpJudge) and judge.url == server.url + "/v1/chat/completions"
  assert [r.score for r in judge.score([_request("5")])] == [0.75]
  assert server.auth[-1] == "Bearer secret"
  cfg.kind = "model"
  with pytest.raises(judge_lib.JudgeError, match="pass the loaded judge model"):
    judge_lib.judge_from_config(cfg)
  cfg.kind = "vllm"
  with pytest.raises(judge_lib.JudgeError, match="kind='vllm'"):
    judge_lib.judge_from_config(cfg)
