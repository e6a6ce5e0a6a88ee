#!/usr/bin/env bash
# The farm on the three JPEG sets of bench/make_sets.sh beside DALI, `--model none`, in one run:
# the default mix, fixed mixes and the GPU decoder's settings, each set's rows alternated over
# ROUNDS rounds (and with a second build, BEFORE, alternated with the first), then DALI's mixed
# pipeline on the same files listed as many times (batches of 32 and 128, `hw_decoder_load` 0.65
# and 0.9), and the whole command's wall time of the farm's default against DALI's whole script
# on the uniform set. Prints markdown rows: images/s after start-up (from the first result) |
# with every producer running (from the moment each had returned a result; the first figure
# where that came soon after the first) | the whole run's | results by CPU / GPU producers; then, for
# each set, the default's ratio to the best fixed mix (the mixes that set producer counts) on
# each of the three measures, and to DALI's best, after start-up, over the rounds.
#
#   bench/photo_folders.sh TENSORPORT_BINARY OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED] [MIXED_PER_SEED]
#
# Defaults 30, 5 and 60 (240 uniform, 40 varied and 480 mixed files, made in well under a
# minute on 16 cores); the lists repeat them: uniform to 45,000 inputs or more, the others to
# 15,000 (mixed) and 4,800 (varied). Environment: BEFORE=BINARY (a second build, alternated),
# ROUNDS (2), SETS ("mixed varied uniform"), MIXES (one per line; default below), NO_DALI=1,
# DEVICE=cpu (the farm's rows on the CPU) and INPUTS=N (each set listed to about N inputs), to
# try the script on a machine without a GPU. ENGINES=1: each farm row, and each of DALI's
# settings (run one at a time then), ends with the GPU's use over the run, the means of `nvidia-smi
# dmon`'s samples each second: its SMs, and its JPEG engines (`jpg`, the share of time they were
# busy) — whether the engines are the bound.
# Needs a CUDA build of tensorport and a GPU; DALI (`nvidia.dali`) for its rows.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
before=${BEFORE:+$(realpath "$BEFORE")}
rounds=${ROUNDS:-2}
device=${DEVICE:-cuda}
"$here/make_sets.sh" "$out" "${3:-30}" "${4:-5}" "${5:-60}"
default_mixes=$'\n-p 0 --gpu-producers 3\n-p 15\n--gpu-upsampling replicate'
mapfile -t mixes <<<"${MIXES-$default_mixes}"

# Writes the set's bench list (its files, sorted, listed enough times over) and says how many
# times over, for DALI to list the folder as often.
bench_list() {
  local set=$1 want files n per
  case $set in uniform) want=45000 ;; varied) want=4800 ;; *) want=15000 ;; esac
  want=${INPUTS:-$want}
  files=$(find "$out/$set" -name '*.jpg' | sort)
  n=$(wc -l <<<"$files")
  per=$(( (want + n - 1) / n ))
  for _ in $(seq "$per"); do echo "$files"; done > "$out/$set.bench.list"
  echo "$per"
}

# With ENGINES=1, samples GPU 0's use each second until `use_end` (15 minutes at most, so a
# run cut short leaves no sampler behind for long).
use_begin() {
  [[ -n ${ENGINES:-} ]] && command -v nvidia-smi >/dev/null || return 0
  nvidia-smi dmon -i 0 -s u -d 1 -c 900 > "$out/dmon.txt" 2>/dev/null &
  dmon=$!
}

# The means of the samples since `use_begin`: "; SMs S%, JPEG engines J% (N s)".
use_end() {
  [[ -n ${ENGINES:-} ]] || return 0
  if [[ -z ${dmon:-} ]]; then printf '; (GPU use not sampled: no nvidia-smi)'; return 0; fi
  kill "$dmon" 2>/dev/null; wait "$dmon" 2>/dev/null || true; dmon=""
  # The header names the columns after a leading "#"; a sample's first column is the GPU's.
  awk '/^# *gpu/ { for (i = 2; i <= NF; i++) col[$i] = i - 1; next }
       /^#/ { next }
       col["jpg"] && NF > 1 { sm += $(col["sm"]); jpg += $(col["jpg"]); n++ }
       END { if (n) printf "; SMs %.0f%%, JPEG engines %.0f%% (%d s)", sm / n, jpg / n, n
             else printf "; (no samples with a jpg column)" }' "$out/dmon.txt"
}

# One farm run: BINARY FLAGS... -> a table row's cells.
farm() {
  local b=$1; shift
  local s after running whole kind use
  use_begin
  s=$("$b" --log warn farm --device "$device" --model none --progress never \
        --output "$out/out.jsonl" "$@" 2>&1) || true
  use=$(use_end)
  after=$(sed -n 's/.*; \([0-9.]*\) after start-up.*/\1/p' <<<"$s")
  running=$(sed -n 's/.*; \([0-9.]*\) with every producer running.*/\1/p' <<<"$s")
  whole=$(sed -n 's/^throughput *\([0-9.]*\) images.*/\1/p' <<<"$s")
  kind=$(sed -n 's/^by kind *CPU producers \([0-9]*\) results, GPU producers \([0-9]*\).*/\1 \/ \2/p' <<<"$s")
  grep -q INCOMPLETE <<<"$s" && kind="$kind INCOMPLETE"
  if [[ -z $after ]]; then
    echo "failed: $(tail -2 <<<"$s" | tr '\n' ' ') | | | "
  else
    echo "$after | ${running:-$after} | $whole | ${kind:-all CPU} ($(wc -l < "$out/out.jsonl") lines)$use"
  fi
}

# The default's ratio to the best fixed mix on one measure: NAME, then RATES' name (an
# associative array: mix, or "default" -> the first build's figures) -> a line.
mix_ratio() {
  local name=$1 best_mix="" best=0 m r vals lo hi
  local -n by=$2
  for m in "${!by[@]}"; do
    [[ $m == -p* || $m == *--gpu-producers* ]] || continue
    for r in ${by[$m]}; do
      if awk -v a="$r" -v b="$best" 'BEGIN { exit !(a > b) }'; then best=$r; best_mix=$m; fi
    done
  done
  vals=$(tr ' ' '\n' <<<"${by[default]:-}" | grep . | sort -n || true)
  [[ -n $vals && -n $best_mix ]] || return 0
  lo=$(head -1 <<<"$vals"); hi=$(tail -1 <<<"$vals")
  awk -v lo="$lo" -v hi="$hi" -v b="$best" -v m="$best_mix" -v n="$name" \
    'BEGIN { printf "  default / best fixed mix, %s (`%s`, %s): %.2f–%.2f×\n", n, m, b, lo / b, hi / b }'
}

# The ratios of a set's rows (RATES, RUNNING, WHOLE) and DALI's lines on stdin -> lines.
ratios() {
  local dali vals lo hi
  dali=$(sed -n 's/.*: \([0-9]*\) images\/s.*/\1/p' | sort -n | tail -1)
  mix_ratio "after start-up" rates
  mix_ratio "with every producer running" running
  mix_ratio "whole run" whole
  vals=$(tr ' ' '\n' <<<"${rates[default]:-}" | grep . | sort -n || true)
  [[ -n $vals && -n $dali ]] || return 0
  lo=$(head -1 <<<"$vals"); hi=$(tail -1 <<<"$vals")
  awk -v lo="$lo" -v hi="$hi" -v d="$dali" \
    'BEGIN { printf "  default / DALI'"'"'s best (%s), after start-up: %.2f–%.2f×\n", d, lo / d, hi / d }'
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
declare -A times_over rates running whole
for set in ${SETS:-mixed varied uniform}; do
  per=$(bench_list "$set"); times_over[$set]=$per
  echo
  echo "== $set: $(find "$out/$set" -name '*.jpg' | wc -l) files, $(wc -l < "$out/$set.bench.list") inputs"
  echo "| round | build | producers / settings | images/s after start-up | every producer running | whole run | by CPU / GPU producers |"
  echo "| --- | --- | --- | ---: | ---: | ---: | --- |"
  rates=(); running=(); whole=()
  for r in $(seq "$rounds"); do
    for mix in "${mixes[@]}"; do
      for name in ${before:+before} after; do
        b=$bin; [[ $name == before ]] && b=$before
        [[ -z $before ]] && name=-
        # shellcheck disable=SC2086
        row=$(farm "$b" --input-list "$out/$set.bench.list" $mix)
        echo "| $r | $name | \`${mix:-default}\` | $row |"
        if [[ $name != before && $row != failed* ]]; then
          IFS='|' read -r a b c _ <<<"$row"
          rates[${mix:-default}]+=" ${a// /}"
          running[${mix:-default}]+=" ${b// /}"
          whole[${mix:-default}]+=" ${c// /}"
        fi
      done
    done
  done
  dali=""
  if [[ -z ${NO_DALI:-} ]] && python3 -c "import nvidia.dali" 2>/dev/null; then
    if [[ -n ${ENGINES:-} ]]; then
      dali=$(for load in 0.65 0.9; do for batch in 32 128; do
        use_begin
        line=$(python3 "$here/peers/dali_jpeg.py" "$out/$set" --pipelines mixed --hw-load $load \
          --batch $batch --threads 15 --repeat "$per" | grep -E "^dali" || true)
        use=$(use_end)
        [[ -n $line ]] && echo "  $line$use"
      done; done)
    else
      dali=$(python3 "$here/peers/dali_jpeg.py" "$out/$set" --pipelines mixed --hw-load 0.65,0.9 \
        --batch 32,128 --threads 15 --repeat "$per" | grep -E "^dali" | sed 's/^/  /' || true)
    fi
    echo "$dali"
  else
    echo "  (DALI not run: NO_DALI set or nvidia.dali not importable)"
  fi
  ratios <<<"$dali"
done

if [[ " ${SETS:-uniform} " == *" uniform "* ]]; then
  per=${times_over[uniform]}
  TIMEFORMAT=%R
  echo
  echo "== the whole command, uniform set ($(wc -l < "$out/uniform.bench.list") inputs), seconds"
  t=$( { time "$bin" --log warn farm --device "$device" --model none --progress never -o /dev/null \
          --input-list "$out/uniform.bench.list" >/dev/null 2>&1; } 2>&1 )
  echo "  tensorport farm (defaults): $t"
  if [[ -z ${NO_DALI:-} ]] && python3 -c "import nvidia.dali" 2>/dev/null; then
    for load in 0.65 0.9; do
      t=$( { time python3 "$here/peers/dali_jpeg.py" "$out/uniform" --pipelines mixed \
              --hw-load $load --batch 128 --threads 15 --repeat "$per" >/dev/null 2>&1; } 2>&1 )
      echo "  dali_jpeg.py, hw_decoder_load $load, batch 128: $t"
    done
  fi
fi
