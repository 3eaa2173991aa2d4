#!/bin/bash
# profile decode during the q32kv 512/32 workload at 0.25 req/s, pull vs push
cd /work/main
for mode in pull push; do
  port=$(.venv/bin/python -c "from kvpush.cluster.launcher import free_port; print(free_port())")
  .venv/bin/kvpush up --model /tmp/models/q32kv --mode $mode --dtype bfloat16 --kv-cache-memory 2GiB --max-model-len 2048 --port $port > /tmp/prof_up_$mode.log 2>&1 &
  up=$!
  for i in $(seq 1 60); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 1; done
  dpid=$(pgrep -f "kvpush serve /tmp/models/q32kv.*--role decode" | head -1)
  .venv/bin/kvpush bench --url http://127.0.0.1:$port --input-len 512 --output-len 32 --num-prompts 2 --request-rate inf --seed 99 --no-progress > /dev/null 2>&1
  .venv/bin/py-spy record --pid $dpid --duration 45 --rate 50 --format raw -o /tmp/prof_$mode.txt --nonblocking > /tmp/prof_spy_$mode.log 2>&1 &
  spy=$!
  .venv/bin/kvpush bench --url http://127.0.0.1:$port --input-len 512 --output-len 32 --num-prompts 8 --request-rate 0.25 --seed 0 --no-progress --out /tmp/prof_bench_$mode.json 2>&1 | grep -i "TPOT\|TTFT" | head -4
  wait $spy
  kill -INT $up; wait $up
done
