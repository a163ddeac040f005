"""What a vLLM user reaches for, against roseinfer's server (chapter 19): chat, logprobs, penalties, tokenize,
errors, an API key, vLLM's metric names, and a request that fails alone.

    ./openai_example.sh
    ./openai_example.sh --model path/to/llama-dir

Starts `python -m roseinfer serve --api-key KEY` with the bundled tiny Llama (it has a chat template) on a free
port of 127.0.0.1, talks to it with the official `openai` client and plain HTTP, and stops it with SIGTERM.
Every request is greedy, so the text printed is the same on every run.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import httpx
import openai

from benchmarks.common import free_port, start_server

LLAMA = "roseinfer/models/tiny-llama-shakespeare"
KEY = "sk-chapter-19"


def start(model: str) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "roseinfer", "serve", "--model", model, "--port", str(port), "--device", "cpu",
           "--api-key", KEY]  # fmt: skip
    server = start_server(cmd, port, timeout=120, stderr=subprocess.DEVNULL)  # this checkout's roseinfer, offline
    return server, f"http://127.0.0.1:{port}", cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=LLAMA)
    args = ap.parse_args()
    server, base, cmd = start(args.model)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        print(f"$ python {' '.join(cmd[1:])}\n")
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        hail = [{"role": "user", "content": "Who goes there?"}]

        r = client.chat.completions.create(model="roseinfer", messages=hail, max_tokens=16, temperature=0)
        print(f"1. chat: {r.choices[0].message.content!r}  finish_reason={r.choices[0].finish_reason}")

        r = client.completions.create(model="roseinfer", prompt="ROMEO.\nBut soft", max_tokens=4, temperature=0,
                                      logprobs=2, echo=True)  # fmt: skip
        lp = r.choices[0].logprobs
        print("\n2. completion with echo and logprobs=2: each token, its logprob, the 2 most likely")
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            shown = "" if top is None else "  ".join(f"{t!r} {v:.2f}" for t, v in top.items())
            print(f"   {tok!r:>12}  {'' if value is None else f'{value:6.2f}':>6}   {shown}")

        print("\n3. the same prompt, greedy, with penalties (vLLM's extra fields go in extra_body):")
        for extra in ({}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.5}, {"stop": [" am"]},
                      {"stop": [" am"], "include_stop_str_in_output": True}, {"logit_bias": {"11": 5.0}}):  # fmt: skip
            r = client.completions.create(model="roseinfer", prompt="ROMEO.\nBut soft", max_tokens=12, temperature=0,
                                          extra_body=extra)  # fmt: skip
            print(f"   {str(extra or 'none'):>54}: {r.choices[0].text!r}")

        t = httpx.post(base + "/tokenize", json={"messages": hail}).json()
        print(f"\n4. /tokenize of the chat: {t['count']} tokens of max_model_len {t['max_model_len']}: {t['tokens']}")
        d = httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}).json()
        print(f"   /detokenize: {d['prompt']!r}")

        print("\n5. errors, in OpenAI's shape:")
        for what, path, kwargs in (
            ("no API key", "/v1/models", {}),
            ("bad field", "/v1/completions", {"json": {"prompt": "a", "min_p": 2}, "headers": auth}),
            ("no such route", "/v1/embeddings", {"json": {}, "headers": auth}),
        ):
            method = httpx.post if "json" in kwargs else httpx.get
            e = method(base + path, **kwargs)
            print(f"   {what:>13}: HTTP {e.status_code} {e.json()['error']['message']}")

        print("\n6. /metrics, under vLLM's names (some lines):")
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith(("vllm:request_success_total", "vllm:num_requests_running", "vllm:prompt_tokens_total",
                                "vllm:generation_tokens_total", "vllm:request_queue_time_seconds_count")):  # fmt: skip
                print(f"   {line}")
    finally:
        server.send_signal(signal.SIGTERM)  # drains: in-flight requests finish, then it exits
        print(f"\nSIGTERM: the server exited with status {server.wait(timeout=60)}")


if __name__ == "__main__":
    main()
