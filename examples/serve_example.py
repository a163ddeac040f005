"""The OpenAI-compatible server, end to end (chapter 13): start it, talk to it, read its metrics, stop it.

    ./serve_example.sh
    ./serve_example.sh --model path/to/gpt2-dir --max-tokens 32

Starts `python -m roseinfer serve` on a free port of 127.0.0.1 and, with the official `openai` client:
one completion, one streamed completion (each chunk printed with its arrival time), two prompts with
n = 2 each, then a bad request (the HTTP status and OpenAI-shaped error), and the lines of /metrics about
requests and the KV cache. The server is stopped at the end. For a server that stays up, use ./serve.sh.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx
import openai

from benchmarks.common import free_port, start_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "roseinfer", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--model", args.model] if args.model else []
    server = start_server(cmd, port, timeout=60)  # this checkout's roseinfer, no model-hub downloads
    base = f"http://127.0.0.1:{port}"
    try:
        print(f"$ python {' '.join(cmd[1:])}\nserver up on {base}\n")
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        n = args.max_tokens

        r = client.completions.create(model="roseinfer", prompt="Romeo.\n", max_tokens=n, temperature=0)
        print(f"1. completion: {r.choices[0].text!r}  finish_reason={r.choices[0].finish_reason} usage={r.usage}\n")

        print("2. streamed, one chunk per line (ms since the request):")
        t0 = time.perf_counter()
        for chunk in client.completions.create(model="roseinfer", prompt="KING.", max_tokens=n, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):  # fmt: skip
            ms = (time.perf_counter() - t0) * 1e3
            if chunk.choices:
                print(f"   {ms:7.1f}  {chunk.choices[0].text!r}  {chunk.choices[0].finish_reason or ''}")
            else:
                print(f"   {ms:7.1f}  usage {chunk.usage}")

        r = client.completions.create(model="roseinfer", prompt=["Nurse.\n", "HAMLET.\n"], n=2, max_tokens=n,
                                      temperature=0.8, seed=1)  # fmt: skip
        print("\n3. two prompts, n = 2 (choice index = prompt * n + completion):")
        for c in r.choices:
            print(f"   {c.index}: {c.text!r}")

        bad = httpx.post(base + "/v1/completions", json={"prompt": "Romeo.\n", "top_p": 0})
        print(f"\n4. a bad request: HTTP {bad.status_code} {bad.text}")

        lines = httpx.get(base + "/metrics").text.splitlines()
        print("\n5. /metrics (some lines):")
        shown = (
            "num_requests",
            "kv_cache_usage_perc",
            "request_success",
            "time_to_first_token_seconds_count",
            "generation_tokens",
        )
        for line in lines:
            if line.startswith(tuple(f"vllm:{name}" for name in shown)):
                print(f"   {line}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        print("\nserver stopped")


if __name__ == "__main__":
    main()
