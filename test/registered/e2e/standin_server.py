"""A stand-in for an SGLang server on 127.0.0.1, for the e2e kit's CPU tests.

It answers what the kit and SGLang's load client ask of a server: ``GET /health``, ``/v1/models``
(OpenAI-compatible), ``/model_info``, ``/server_info``, ``POST /flush_cache`` and ``POST /generate``
(one request or a batch; streamed as server-sent events or not). A ``/generate`` answer is
``answer(prompt)``; its ``meta_info`` counts one completion token per word (``max_new_tokens`` when
EOS is ignored) and one target verify step per TOKENS_PER_VERIFY tokens. ``/server_info`` reports
the average accept length SERVER_ACCEPT_LENGTH and the kill switches of the process's environment.

It records every ``/generate`` payload, answers at most ``max_requests`` of them (then 503), and
stops by itself after ``lifetime_s`` seconds. Run as a script, ``python standin_server.py PORT
LIFETIME_S`` serves in the foreground until then.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS_PER_VERIFY = 2
SERVER_ACCEPT_LENGTH = 3.25
SWITCH_ENVS = (
    "SGLANG_DSA_BOUNDED_REPLAY_METADATA",
    "SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE",
    "SGLANG_SPEC_VERIFY_ARGMAX_EXCHANGE",
    "SGLANG_DSA_LIVE_WIDTH",
)
STREAM_STEP_S = 0.002


def _default_answer(prompt) -> str:
    return "The answer is 42."


class StandIn:
    def __init__(
        self,
        *,
        port=0,
        answer=_default_answer,
        model_path="stand-in",
        max_requests=64,
        lifetime_s=30,
    ):
        self.answer = answer
        self.model_path = model_path
        self.max_requests = max_requests
        self.payloads: list[dict] = []
        self.flushes = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def serve_in_background(self) -> StandIn:
        self._timer.start()
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def serve_forever(self) -> None:
        self._timer.start()
        self._serve()

    def _serve(self) -> None:
        self.httpd.serve_forever(poll_interval=0.05)

    def stop(self) -> None:
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def admit(self, payload: dict) -> bool:
        with self._lock:
            if len(self.payloads) >= self.max_requests:
                return False
            self.payloads.append(payload)
            return True

    def completion(self, prompt, params: dict) -> dict:
        text = self.answer(prompt)
        tokens = params["max_new_tokens"] if params.get("ignore_eos") else len(text.split())
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        meta = {
            "completion_tokens": tokens,
            "prompt_tokens": prompt_tokens,
            "spec_verify_ct": math.ceil(tokens / TOKENS_PER_VERIFY),
        }
        return {"text": text, "meta_info": meta}


def _handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, body, status=200):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json({})
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": standin.model_path}]})
            elif self.path == "/model_info":
                path = standin.model_path
                self._json({"model_path": path, "tokenizer_path": path, "is_generation": True})
            elif self.path == "/server_info":
                state = {"avg_spec_accept_length": SERVER_ACCEPT_LENGTH}
                switches = {env: os.environ.get(env) for env in SWITCH_ENVS}
                self._json({"internal_states": [state], "switches": switches})
            else:
                self._json({"error": self.path}, 404)

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if self.path.startswith("/flush_cache"):
                standin.flushes += 1
                self._json({})
            elif self.path == "/generate":
                self._generate(json.loads(body))
            else:
                self._json({"error": self.path}, 404)

        def _generate(self, payload):
            if not standin.admit(payload):
                self._json({"error": "request budget spent"}, 503)
                return
            prompt = payload.get("text", payload.get("input_ids"))
            params = payload["sampling_params"]
            if not payload.get("stream"):
                batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
                if batch:
                    self._json([standin.completion(p, params) for p in prompt])
                else:
                    self._json(standin.completion(prompt, params))
                return
            done = standin.completion(prompt, params)
            first = {"text": "tok", "meta_info": dict(done["meta_info"], completion_tokens=1)}
            last = {"text": " ".join(["tok"] * done["meta_info"]["completion_tokens"])}
            last["meta_info"] = done["meta_info"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in (first, last):
                time.sleep(STREAM_STEP_S)
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


if __name__ == "__main__":
    StandIn(port=int(sys.argv[1]), lifetime_s=float(sys.argv[2])).serve_forever()
