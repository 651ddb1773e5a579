"""`tandem bench`: load-test a serving endpoint and draw what happened (the bench process).

What `vllm bench serve` measures, against any OpenAI-compatible server or Tandem's gRPC API:
completed/failed requests, request and token throughput, TTFT, TPOT, ITL and end-to-end
latency (mean, median, p90, p99), and goodput under TTFT/TPOT SLOs; ``--out DIR`` writes
results.json (summary + every request's timestamps) and PNG plots.

Files, one idea each: ``config`` (frozen flag groups), ``datasets`` (prompts), ``backends``
(send one request, time its stream), ``runner`` (arrivals and concurrency), ``record`` (one
request's outcome), ``metrics`` (pure summary math), ``plots``, ``report`` (table, JSON,
comparison), ``cli`` (flags).

Against Tandem's own router (workers as in README.md; the router prints
``TANDEM_ROUTER_READY {"http": ..., "grpc": ...}`` once it listens)::

    python -m decode_worker  --port 50061 --kv-backend auto &
    python -m prefill_worker --port 50062 --kv-backend auto &
    python -m router --model smollm2-135m-instruct --prefill 127.0.0.1:50062 --decode 127.0.0.1:50061 \
        --http-port 8000 --grpc-port 50051 &
    tandem bench --backend openai-chat --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --dataset random --input-len 512 --output-len 64 --num-prompts 200 --request-rate 4 \
        --max-concurrency 32 --ignore-eos --slo-ttft-ms 500 --slo-tpot-ms 50 --out runs/pd
    tandem bench --backend grpc --grpc-target 127.0.0.1:50051 --dataset shared-prefix \
        --num-groups 4 --prefix-len 1024 --suffix-len 32 --output-len 64 --out runs/pd-grpc
    tandem bench --compare runs/colocated/results.json runs/pd/results.json

(``python -m deploy.cli bench ...`` is the same command without the installed script.) With an
API key on the router, pass the same ``--api-key``. For vLLM or SGLang, point ``--base-url`` at
the server and give ``--model`` the served name and ``--tokenizer`` that model's tokenizer.
"""
