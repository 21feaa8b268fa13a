"""A command-line client in the spirit of the seeds' inflight_batcher_llm_client.py.

    python tools/client.py --text "What is machine learning?" --request-output-len 40 --streaming
    python tools/client.py --streaming --stop-after-ms 200 --request-output-len 200
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import httpx


def build_body(args) -> dict:
    body = {"text_input": args.text, "max_tokens": args.request_output_len, "return_perf_metrics": True}
    for name in ("top_k", "top_p", "temperature", "beam_width", "seed", "end_id", "pad_id", "min_tokens",
                 "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    if args.stop_words:
        body["stop_words"] = args.stop_words
    if args.bad_words:
        body["bad_words"] = args.bad_words
    if args.return_log_probs:
        body["return_log_probs"] = True
    return body


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-u", "--url", default="http://localhost:8000")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--text", default="Born in north-east France, Soyer trained as a")
    parser.add_argument("--request-output-len", type=int, default=32)
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--stop-after-ms", type=int, default=None, help="cancel the request after this long")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--beam-width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--end-id", type=int, default=None)
    parser.add_argument("--pad-id", type=int, default=None)
    parser.add_argument("--min-tokens", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--stop-words", nargs="*", default=None)
    parser.add_argument("--bad-words", nargs="*", default=None)
    parser.add_argument("--return-log-probs", action="store_true")
    args = parser.parse_args(argv)

    body = build_body(args)
    route = "generate_stream" if args.streaming or args.stop_after_ms else "generate"
    url = f"{args.url}/v2/models/{args.model}/{route}"
    print(f"Input: {args.text}")
    start = time.perf_counter()
    text, last = "", {}
    with httpx.Client(timeout=600) as client:
        if route == "generate":
            response = client.post(url, json=body)
            last = response.json()
            if response.status_code != 200:
                print(f"error {response.status_code}: {last.get('error')}", file=sys.stderr)
                return 1
            text = last["text_output"]
        else:
            with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    print(f"error {response.status_code}: {response.read().decode()}", file=sys.stderr)
                    return 1
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    last = json.loads(line[6:])
                    if "error" in last:
                        print(f"\nstream error: {last['error']}", file=sys.stderr)
                        return 1
                    text += last["text_output"]
                    print(last["text_output"], end="", flush=True)
                    if args.stop_after_ms and (time.perf_counter() - start) * 1000 >= args.stop_after_ms:
                        print("\n[stopped by the client: the server aborts the request]")
                        break
            print()
    latency_ms = (time.perf_counter() - start) * 1000
    print(f"Output: {text}")
    print(f"[INFO] Latency: {latency_ms:.3f} ms")
    for key in ("finish_reason", "kv_cache_hit_rate", "kv_cache_reused_block", "arrival_time_ns",
                "first_token_time_ns", "last_token_time_ns"):
        if key in last:
            print(f"[INFO] {key}: {last[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
