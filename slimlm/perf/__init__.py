"""`compress bench`: the speed and memory a checkpoint buys, measured against its baseline in the same run.

Offline, on the engine's model runner (no scheduler in the way):
- prefill: tokens/s of one `prefill_len`-token prompt in one forward pass;
- decode: the step at each batch size with every sequence holding `context` tokens of KV (the cache holds
  random values: a step's cost does not depend on them), as tokens/s and against the bandwidth floor, the
  bytes a step must read (the weights as stored, every sequence's KV) ÷ the copy bandwidth measured in
  this run;
- memory: weight bytes, KV bytes per token, the largest batch the KV pool holds at `context`, and the peak
  resident memory while the model was loaded and measured (Linux resets the peak per model).
Online, through the engine (with `http`, also to `compress serve` over HTTP): a seeded Poisson workload
(prompts cut from the bundled owt text, lengths uniform in `prompt_len`, outputs uniform in `output_len`,
greedy with EOS ignored): output tokens/s, TTFT and inter-token latency p50/p90/p99, and goodput, the
requests per second that met the SLO (TTFT ≤ `slo_ttft` and mean inter-token latency ≤ `slo_itl`),
and the output throughput against the workload's roofline (`plan.serving_roofline`: its arithmetic at the
matmul rate and its bytes at the copy bandwidth, both measured in this run, or its last arrival; a rate of
inf sends every request at once, which saturates the engine).
The baseline (by default the float source named in the checkpoint's slimlm.json) is measured in the same
process and every figure gets a ratio. The offline part runs in `rounds`, the baseline and the checkpoint in
turn, and keeps each timing's median over the rounds: on a shared machine a neighbour's burst can slow one
system's whole measurement (a demo run beside a test suite once reported an 88× RTN speedup from one such
baseline), and alternating rounds put both systems through the same minutes. The online workload runs in as
many rounds, in turn too, and keeps each system's run of median throughput (one run per system moved the
ratio 0.94-1.13x between two runs of one command). Each part also records how many cores other processes
(and the hypervisor) kept busy meanwhile, and the result carries a warning where that was enough to move the
ratios.

The parts, one module each: config.py (the settings, and the engine they build), offline.py (timed forward
passes on the model runner), workload.py (the Poisson workload through the engine), http.py (the same workload
over HTTP), load.py (peak memory and other processes' load), bench.py (the systems in turn, ratios, the table).
"""
