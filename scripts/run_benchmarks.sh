#!/usr/bin/env bash
# Run dsa-train's benchmarks one after another and print their tables.
set -euo pipefail

usage() {
    cat <<USAGE
Usage: scripts/run_benchmarks.sh [--quick] [--dir DIR]

Runs, one at a time (they must not share the CPU):
  1. scripts/bench_optimizer.py        DiskSparseAdam vs SparseAdam: step time (cold, warm, out
                                       of core) and memory
  2. scripts/bench_throughput.py       training throughput with dsa vs sparse_adam (KGE, node2vec)
     scripts/bench_contention.py       the same next to CPU- and I/O-bound neighbour processes
  3. scripts/bench_inspect_state.py    inspect-state time and memory on 1M and 10M rows
  4. scripts/bench_walks.py            walk-sampling throughput on a generated graph
  5. scripts/bench_out_of_core.py      a DiskEmbedding table larger than RAM: rows/s, prefetch,
                                       the disk's random-read rate (needs ~46 GB free in --dir)
     scripts/bench_partitioned.py      the same table in partition order against random order and
                                       the page cache, and the disk's sequential rates

Options:
  --quick     small sizes, a few minutes in all (the full run takes about an hour,
              16 GB of RAM, 46 GB of disk, and FB15k-237 under the data root for step 2)
  --dir DIR   where the benchmarks put their state files (default: the temp dir)
  -h, --help  show this help
USAGE
}

quick=0
dir_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1; shift ;;
        --dir) dir_args=(--dir "$2"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "Error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
state_args=()
[ ${#dir_args[@]} -gt 0 ] && state_args=(--state-dir "${dir_args[1]}")

echo "== 1. optimizer step time and memory"
if [ "$quick" = 1 ]; then
    "$python" "$here/scripts/bench_optimizer.py" --quick "${state_args[@]}"
else
    "$python" "$here/scripts/bench_optimizer.py" "${state_args[@]}"
fi
echo
echo "== 2. training throughput"
if [ "$quick" = 1 ]; then
    "$python" "$here/scripts/bench_throughput.py" "$here/recipes/quickstart.yaml" --steps 60 --repeats 1
    "$python" "$here/scripts/bench_throughput.py" "$here/recipes/karate-node2vec.yaml" --steps 30 --repeats 1
    "$python" "$here/scripts/bench_contention.py" --steps 60 --repeats 1 --conditions none,cpu
else
    "$python" "$here/scripts/bench_throughput.py" "$here/recipes/fb15k237-distmult.yaml" --steps 200
    "$python" "$here/scripts/bench_throughput.py" "$here/recipes/cora-node2vec.yaml" --steps 60
    "$python" "$here/scripts/bench_contention.py" --steps 300 --repeats 3
fi
echo
echo "== 3. inspect-state at scale"
if [ "$quick" = 1 ]; then
    "$python" "$here/scripts/bench_inspect_state.py" --rows 100000 1000000 --touched 10000 "${dir_args[@]}"
else
    "$python" "$here/scripts/bench_inspect_state.py" "${dir_args[@]}"
fi
echo
echo "== 4. walk sampling"
if [ "$quick" = 1 ]; then
    "$python" "$here/scripts/bench_walks.py" --nodes 1000000 --walks 20000
else
    "$python" "$here/scripts/bench_walks.py"
fi
echo
echo "== 5. tables larger than RAM"
ooc_dir="${dir_args[1]:-${TMPDIR:-/tmp}}/dsa-out-of-core"
if [ "$quick" = 1 ]; then
    "$python" "$here/scripts/bench_out_of_core.py" --dir "$ooc_dir" --quick
    "$python" "$here/scripts/bench_partitioned.py" --dir "$ooc_dir" --quick
else
    "$python" "$here/scripts/bench_out_of_core.py" --dir "$ooc_dir"
    "$python" "$here/scripts/bench_partitioned.py" --dir "$ooc_dir"
fi
