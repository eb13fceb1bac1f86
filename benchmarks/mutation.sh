#!/usr/bin/env bash
# Mutation testing of the core modules with mutmut: small deliberate bugs (an operator, a constant, a
# dropped call) are planted one at a time, and each must make at least one test fail. Not in CI (minutes
# per module); results under benchmarks/results/mutation-<module>.txt.
#
#   bash benchmarks/mutation.sh                         # every core module
#   bash benchmarks/mutation.sh slimlm/runtime/sampling.py [...]   (MUTATION_JOBS=N: parallel mutants)
#
# Each module runs in a scratch copy of the tree (the working tree is never touched) with only the fast
# tests that exercise it; mutmut maps every mutant to the tests that reach its function and runs just those.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
"$PY" -m pip install --quiet --disable-pip-version-check mutmut==3.8.1

# module -> the tests that cover it
declare -A TESTS=(
  [slimlm/compress/quantize.py]="tests/compress/test_quantize.py"
  [slimlm/compress/gptq.py]="tests/compress/test_gptq.py"
  [slimlm/compress/awq.py]="tests/compress/test_awq.py"
  [slimlm/compress/autoround.py]="tests/compress/test_autoround.py"
  [slimlm/compress/mixed_precision.py]="tests/compress/test_mixed_precision.py"
  [slimlm/formats/packing.py]="tests/formats tests/kernels/test_packed.py"
  [slimlm/formats/compressed_tensors.py]="tests/formats/test_compressed_tensors.py"
  [slimlm/formats/gptq_v1.py]="tests/formats/test_gptq_v1.py"
  [slimlm/formats/awq_gemm.py]="tests/formats/test_awq_gemm.py"
  [slimlm/formats/reader.py]="tests/formats"
  [slimlm/kernels/reference.py]="tests/kernels"
  [slimlm/kernels/__init__.py]="tests/kernels/test_dispatch.py"
  [slimlm/runtime/sampling.py]="tests/runtime/test_sampling.py"
  [slimlm/runtime/block_manager.py]="tests/runtime/test_block_manager.py tests/runtime/test_scheduler.py tests/runtime/test_engine.py tests/runtime/test_kv_policy.py"
  [slimlm/runtime/kv_policy.py]="tests/runtime/test_kv_policy.py tests/runtime/test_engine_speculative.py::test_greedy_output_equals_non_speculative_greedy_under_a_kv_policy"
  [slimlm/eval/long_context.py]="tests/eval/test_long_context.py"
  [slimlm/runtime/scheduler.py]="tests/runtime/test_scheduler.py tests/runtime/test_engine.py"
  [slimlm/kernels/cpu_layer.py]="tests/kernels/test_cpu_layer.py tests/kernels/test_dispatch.py tests/runtime/test_model.py"
  [slimlm/runtime/sequence.py]="tests/runtime/test_engine.py tests/runtime/test_scheduler.py tests/runtime/test_block_manager.py"
  [slimlm/runtime/engine.py]="tests/runtime/test_engine.py tests/runtime/test_fuzz.py tests/runtime/test_engine_speculative.py::test_greedy_output_equals_non_speculative_greedy tests/runtime/test_engine_speculative.py::test_bad_speculative_settings_are_named tests/runtime/test_engine_speculative.py::test_greedy_speculation_is_exact_under_preemption_and_parallel_samples tests/runtime/test_engine_speculative.py::test_drafts_respect_the_token_budget_max_tokens_and_the_context"
  [slimlm/runtime/speculative.py]="tests/runtime/test_speculative.py"
  [slimlm/formats/kv_cache.py]="tests/formats/test_kv_cache.py tests/runtime/test_kv_cache.py tests/compress/test_kv.py"
  [slimlm/formats/quantized.py]="tests/formats tests/compress/test_quantize.py tests/kernels/test_packed.py"
  [slimlm/formats/shards.py]="tests/formats tests/compress/test_offload.py"
  [slimlm/formats/writer.py]="tests/formats tests/compress/test_kv.py tests/runtime/test_loader.py"
  [slimlm/formats/atomic.py]="tests/formats"
  [slimlm/formats/manifest.py]="tests/formats"
  [slimlm/kernels/cpu_gemm.py]="tests/kernels/test_cpu_gemm.py tests/kernels/test_dispatch.py"
  [slimlm/kernels/packed.py]="tests/kernels/test_packed.py tests/kernels/test_cpu_gemm.py tests/kernels/test_dispatch.py"
  [slimlm/serve/protocol.py]="tests/serve/test_app.py"
  [slimlm/serve/metrics.py]="tests/serve/test_metrics.py"
  [slimlm/serve/async_engine.py]="tests/serve/test_app.py tests/serve/test_load.py"
  [slimlm/train/prune.py]="tests/train/test_prune.py"
  [slimlm/train/gqa.py]="tests/train/test_gqa.py"
  [slimlm/train/distill.py]="tests/train/test_distill.py::test_one_step_equals_a_hand_written_distillation_step tests/train/test_distill.py::test_the_sliced_loss_and_its_gradients_equal_the_definition_on_whole_logits tests/train/test_distill.py::test_the_last_hidden_state_through_the_head_is_the_models_logits tests/train/test_distill.py::test_passes_run_in_the_fast_dtype_or_the_one_asked_for tests/train/test_distill.py::test_a_run_that_cannot_fit_is_refused_before_it_starts_and_one_that_fits_recomputed_recomputes tests/train/test_distill.py::test_the_learning_rate_warms_up_then_decays_to_zero tests/train/test_distill.py::test_budgets_and_batches_that_cannot_run_are_named tests/train/test_distill.py::test_a_checkpoint_resumes_only_the_same_source_options_and_data tests/train/test_distill.py::test_two_runs_never_train_in_one_run_directory tests/train/test_distill.py::test_the_loop_logs_checkpoints_and_resumes_in_process tests/train/test_distill.py::test_the_curve_plots_loss_and_evaluation_perplexity_against_tokens tests/train/test_distill.py::test_train_parts_that_match_nothing_are_named tests/train/test_gqa.py tests/train/test_prune.py"
  [slimlm/eval/plan.py]="tests/eval/test_plan.py"
  [slimlm/eval/batch.py]="tests/eval/test_batch.py tests/eval/test_lm_eval_model.py"
  [slimlm/perf/bench.py]="tests/perf/test_bench.py"
  [slimlm/eval/report.py]="tests/eval/test_report.py tests/eval/test_records.py"
  [slimlm/jobs/options.py]="tests/jobs tests/test_cli.py"
  [slimlm/serve/serving.py]="tests/serve/test_serving.py tests/serve/test_app.py"
  [slimlm/recipe.py]="tests/test_recipe.py::test_malformed_recipes_name_the_file_line_and_field tests/test_recipe.py::test_a_missing_recipe_is_named tests/test_recipe.py::test_options_become_the_commands_own_jobs tests/test_recipe.py::test_an_override_with_a_newline_is_quoted_so_the_error_stays_one_line tests/test_recipe.py::test_set_refusals_are_whole_sentences tests/test_recipe.py::test_a_loaded_recipe_holds_its_fields_and_names_the_overrides_behind_an_error tests/test_recipe.py::test_overrides_are_checked_too tests/test_recipe.py::test_check_refuses_what_the_run_would tests/test_recipe.py::test_check_refuses_a_stage_directory_it_did_not_write tests/test_recipe.py::test_every_shipped_recipe_is_valid tests/test_recipe.py::test_any_set_gives_a_valid_recipe_or_a_one_line_error tests/test_recipe.py::test_a_run_does_each_step_once_reuses_shared_chains_and_redoes_what_changed tests/test_recipe.py::test_a_stage_directory_is_refused_unless_its_run_json_names_the_stage tests/test_recipe.py::test_a_second_recipe_is_refused_the_first_ones_stages tests/test_recipe.py::test_an_alias_bomb_and_a_recursive_alias_are_refused_in_one_line_at_once tests/test_recipe.py::test_set_changes_the_one_path_it_names_even_where_an_alias_shared_it tests/test_recipe.py::test_a_stage_name_with_a_newline_is_quoted_in_its_one_line_error tests/test_recipe.py::test_aliases_are_counted_exactly_once_per_use tests/test_recipe.py::test_an_output_hash_covers_every_file_of_a_directory_by_name"
)
# a module's tests that run too long to repeat per mutant (end-to-end runs: their logic is covered by faster tests)
declare -A DESELECT=(
  [slimlm/recipe.py]="nosuch_task"
)
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=("${!TESTS[@]}")

mkdir -p benchmarks/results
for module in "${MODULES[@]}"; do
  tests=${TESTS[$module]:-}
  [ -n "$tests" ] || { echo "no tests listed for $module in benchmarks/mutation.sh" >&2; exit 2; }
  work=$(mktemp -d "${TMPDIR:-/tmp}/slimlm-mutation.XXXXXX")
  git ls-files -z slimlm tests pyproject.toml | xargs -0 cp --parents -t "$work"
  test_list=$(printf '"%s", ' $tests)
  deselect=${DESELECT[$module]:-}
  extra=${deselect:+, \"-k\", \"not $deselect\"}
  cat >> "$work/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["slimlm"]
only_mutate = ["$module"]
pytest_add_cli_args_test_selection = [${test_list%, }]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"$extra]
process_isolation = "forkserver"
EOF
  name=$(echo "$module" | tr '/' '-' | sed 's/\.py$//')
  echo "== $module (tests: $tests)"
  start=$(date +%s)
  (cd "$work" && HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TQDM_DISABLE=1 "$ROOT/.venv/bin/mutmut" run --max-children "${MUTATION_JOBS:-$(nproc)}" > run.log 2>&1 || true)
  (cd "$work" && "$ROOT/.venv/bin/mutmut" results --all true > results.txt 2>&1 || true)
  # each survivor's diff, to kill it with a test or to say why it is equivalent
  (cd "$work" && for m in $(grep -E ': (survived|no tests|timeout|suspicious)$' results.txt | cut -d: -f1); do
     "$ROOT/.venv/bin/mutmut" show "$m" 2>/dev/null | grep -E '^[-+][^-+]' | sed "s|^|$m  |"; done > diffs.txt || true)
  seconds=$(( $(date +%s) - start ))
  "$PY" - "$work/results.txt" "$work/diffs.txt" "$module" "$seconds" "benchmarks/results/mutation-$name.txt" <<'EOF'
import collections, sys
results, diffs, module, seconds, out = sys.argv[1:]
status = {}
for line in open(results):
    if ":" in line and "__mutmut_" in line:
        mutant, state = line.rsplit(":", 1)
        status[mutant.strip()] = state.strip()
counts = collections.Counter(status.values())
killed = counts.get("killed", 0) + counts.get("segfault", 0)  # a crash of the tests detects the mutant too
scored = sum(counts.values()) - counts.get("skipped", 0)
lines = [f"{module}: {killed}/{scored} mutants killed ({killed / max(1, scored):.0%}) in {seconds} s",
         "  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
         "survivors (mutant, then its diff):", *open(diffs).read().splitlines()]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines[:2]))
EOF
  rm -rf "$work"
done
