#!/usr/bin/env python3
"""TEST STAND-IN for `python -m sglang.launch_server`, for machines without GPUs (CI). Not SGLang.

SGLang cannot run on a CPU machine, so the generate and benchmark stages are tested against this server: the
same flags, the same endpoints, real answers. It serves a small HF model (the tiny target) with
transformers' greedy generation, and with --speculative-algorithm EAGLE3 it decodes with the exported drafter
(eagle3.stages.evaluate's speculative decoding), so the accept lengths it reports are measured, not made up.

Endpoints (the subset the stages use):
  GET  /health                  200 once the model is loaded
  GET  /v1/models               the served model
  POST /v1/chat/completions     OpenAI chat completion: choices[0].message.content (+ reasoning_content), usage
  POST /generate                SGLang's native API with input_ids; meta_info: completion_tokens, and with
                                speculation spec_verify_ct (verify steps) and spec_num_correct_drafts, as
                                SGLang reports them
  POST /stand-in/misbehave      {"flags": [...]}: the "stand-in" options below, replacing the current ones
                                once no chat request is in flight (a test's own misbehaviour without a server
                                start of its own: loading the model is most of what a start costs)

Run by the stages through EAGLE3_SERVER_LAUNCHER=tests/fakes/sglang_server.py, or by a test directly. The
options after "stand-in" below make it misbehave, for the retry, threshold and lifecycle tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "include"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    g = p.add_argument_group("stand-in", "misbehaviour on purpose")
    g.add_argument(
        "--faults",
        default="",
        help="comma list consumed one per chat request, in order: ok, 500, 429, drop (close the "
        "connection without an answer), slow (sleep --slow-s first), empty (an empty message)",
    )
    g.add_argument("--always", default="", help="every chat request fails this way (500, 429, drop)")
    g.add_argument("--slow-s", type=float, default=5.0)
    g.add_argument("--reasoning", default="", help="return this as every answer's reasoning_content")
    g.add_argument("--startup-delay-s", type=float, default=0.0, help="serve /health only after this long")
    g.add_argument("--exit-at-start", type=int, default=None, help="exit with this code instead of serving")
    g.add_argument("--record", default=None, help="append each chat request's messages to this JSONL file")
    g.add_argument(
        "--tool-call",
        default="",
        help="answer a request that offers tools, and whose last message is "
        "no tool result, with a call of this function (as a tool-calling model would)",
    )
    args, _ = p.parse_known_args(argv)  # SGLang flags it does not model (tp size, dtype, ...) are accepted
    return args


class Model:
    """The HF model, greedy, one request at a time (the lock: torch on 2 CPU cores gains nothing from more)."""

    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.torch = torch
        self.lock = threading.Lock()
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        eos = self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.speculative = None
        if args.speculative_algorithm:
            self.speculative = self._load_drafter(args)

    def _load_drafter(self, args):
        from eagle3.capture.hf import HfCapture
        from eagle3.config import parse_run_config
        from eagle3.stages.export import load_exported_drafter
        from eagle3.target import resolve_target_facts

        drafter, d2t = load_exported_drafter(args.speculative_draft_model_path, args.model_path)
        cfg = resolve_target_facts(
            parse_run_config(
                {
                    "run_name": "stand-in",
                    "workdir": "/nonexistent",
                    "data": {"path": "/nonexistent"},
                    "target": {"model_path": args.model_path, "dtype": "float32"},
                    "extract": {"aux_layers": list(drafter.cfg.aux_layer_ids), "device": "cpu"},
                    "vocab": {"draft_vocab_size": drafter.cfg.draft_vocab_size},
                }
            )
        )
        return HfCapture(cfg), drafter, d2t, args.speculative_num_steps

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, int, int, str]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        new, _ = self.generate(ids, max_tokens)
        finish = "stop" if new and new[-1] in self.eos else "length"
        return self.tokenizer.decode(new, skip_special_tokens=True), len(ids), len(new), finish

    def generate(self, ids: list[int], max_new: int) -> tuple[list[int], list[int] | None]:
        """New tokens, and when speculating the drafts accepted at each verify step."""
        with self.lock, self.torch.no_grad():
            if self.speculative is not None:
                from eagle3.stages.evaluate.decoding import speculative_greedy

                target, drafter, d2t, k = self.speculative
                new, accepted = speculative_greedy(target, drafter, d2t, ids, k, max_new, self.eos)
                return new, accepted
            out = self.model.generate(
                self.torch.tensor([ids]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=list(self.eos),
                pad_token_id=next(iter(self.eos)),
            )
            return out[0, len(ids) :].tolist(), None


class Misbehaviour:
    """The "stand-in" options in force, and what is left of --faults. Chat requests pick their fault under the
    condition's lock; `replace` waits there until no chat request is in flight."""

    def __init__(self, args):
        self.in_flight, self.changed = 0, threading.Condition()
        self._take(args)

    def _take(self, args) -> None:
        self.args, self.faults = args, iter(f.strip() for f in args.faults.split(",") if f.strip())

    def replace(self, args, timeout_s: float = 60.0) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.in_flight == 0, timeout_s):
                raise TimeoutError(f"{self.in_flight} chat request(s) still in flight after {timeout_s:.0f} s")
            self._take(args)

    def start_request(self, body: dict):
        """This request's fault and the options it runs under; call end_request when it is answered."""
        with self.changed:
            self.in_flight += 1
            args = self.args
            fault = args.always or next(self.faults, "ok")
            if args.record:
                with open(args.record, "a") as f:
                    f.write(
                        json.dumps({"messages": body["messages"], "tools": body.get("tools"), "fault": fault}) + "\n"
                    )
            return fault, args

    def end_request(self) -> None:
        with self.changed:
            self.in_flight -= 1
            self.changed.notify_all()


def serve(args) -> None:
    if args.exit_at_start is not None:
        print("stand-in: exiting at start, as told", flush=True)
        sys.exit(args.exit_at_start)
    started = time.monotonic()
    state = {"model": None}
    misbehaviour = Misbehaviour(args)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # one line per request in the server log, like a real server
            print(f"stand-in: {self.address_string()} {fmt % a}", flush=True)

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            ready = state["model"] is not None and time.monotonic() - started >= args.startup_delay_s
            if self.path == "/health":
                self.reply(200 if ready else 503, {})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": args.model_path, "object": "model"}]})
            else:
                self.reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/chat/completions":
                self.chat(body)
            elif self.path == "/generate":
                self.native_generate(body)
            elif self.path == "/stand-in/misbehave":
                try:
                    misbehaviour.replace(parse_args(["--model-path", args.model_path, *body.get("flags", [])]))
                except TimeoutError as err:
                    self.reply(409, {"error": str(err)})
                    return
                self.reply(200, {"flags": body.get("flags", [])})
            else:
                self.reply(404, {"error": f"no route {self.path}"})

        def chat(self, body: dict) -> None:
            fault, options = misbehaviour.start_request(body)
            try:
                self.answer_chat(body, fault, options)
            finally:
                misbehaviour.end_request()

        def answer_chat(self, body: dict, fault: str, options) -> None:
            if fault == "drop":
                self.close_connection = True
                self.connection.shutdown(2)  # the client sees the connection end with no answer
                return
            if fault in ("500", "429"):
                self.reply(int(fault), {"error": {"message": f"stand-in fault {fault}"}})
                return
            if fault == "slow":
                time.sleep(options.slow_s)
            content, prompt_tokens, completion_tokens, finish = state["model"].chat(
                body["messages"], body.get("max_tokens", 256)
            )
            message = {"role": "assistant", "content": "" if fault == "empty" else content}
            if options.tool_call and body.get("tools") and body["messages"][-1]["role"] != "tool":
                message = {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call_{next(counter)}",
                            "type": "function",
                            "function": {"name": options.tool_call, "arguments": "{}"},
                        }
                    ],
                }
            if options.reasoning:
                message["reasoning_content"] = options.reasoning
            self.reply(
                200,
                {
                    "id": f"chatcmpl-{next(counter)}",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    },
                },
            )

        def native_generate(self, body: dict) -> None:
            t0 = time.monotonic()
            params = body.get("sampling_params", {})
            new, accepted = state["model"].generate(body["input_ids"], params.get("max_new_tokens", 128))
            meta = {
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(new),
                "e2e_latency": time.monotonic() - t0,
            }
            if accepted is not None:
                meta["spec_verify_ct"] = max(len(accepted), 1)
                meta["spec_num_correct_drafts"] = sum(accepted)
            self.reply(
                200,
                {
                    "text": state["model"].tokenizer.decode(new, skip_special_tokens=True),
                    "output_ids": new,
                    "meta_info": meta,
                },
            )

    counter = itertools.count()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()  # /health says 503 while loading
    print(f"stand-in: listening on {args.host}:{args.port}, loading {args.model_path}", flush=True)
    state["model"] = Model(args)
    print("stand-in: model loaded; serving", flush=True)
    threading.Event().wait()  # until a signal ends the process


if __name__ == "__main__":
    serve(parse_args())
