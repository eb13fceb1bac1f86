"""Quality and speed measurement: perplexity now; lm-eval tasks, bench, plan and report later."""
