#!/usr/bin/env bash
# The H200 measurements issue 21 still owes, as parts of at most ~9 minutes each, so a
# session spends its 30 device minutes in three or four calls: A, B, then E or C. Committed (not in the gitignored
# .carry/) so a fresh checkout has it. On this machine, once a session:
#
#   mkdir -p .carry && cp -r ../shared/data .carry/ && echo /.carry/ >> .git/info/exclude
#
# then, with the device tool: run(command="bash benchmarks/jobs/issue21_h200.sh A",
# carry=[".carry"], timeout_s=600); the JSON comes back under $OUT (copy it into
# benchmarks/results/ and set its git_commit: the device copy has no .git).
# NOTE: in session 23 the device copy's .git said 753834a for trees committed after it. Every
# bench JSON now also carries ``source_digest`` (mrv2/**/*.py as it ran), and
#   python -c 'from mrv2.bench.report import commit_of_digest as c; print(c("<digest>"))'
# here names the commit it matches (None: uncommitted edits).
#   A  split-K small_m_fused (3-32 rows): GPU tests, the 28-layer chain, TPOT A/B
#   B  the batch-256 step's attention (bench decode b256 at 96 keys, the host-bound mean):
#      default / DECODE_ONE_LOOP / decode_heads 8 and 2 KV heads a program / paged launch of
#      32 keys x 4 warps (94 registers, 5 programs an SM offline, against 242 and 4); then
#      host-bound v2,v1 default vs decode_heads (swap in B's winner)
#   C  the book's GPU figures (chapters 01, 05, 08, 10) at main's defaults
#   D  (if time is left) PREFETCH_MAX_REQS 8 / 16 / 32 at batch 16-32
#   F  (session 18) the fixed decode_heads GPU tests, the standard workload's per-step CPU/GPU
#      split (--timeline: is its wall-over-GPU gap at long contexts the host?), then D
#   G  (session 19) where the standard workload's decode loses 25%: bench decode at 64 / 128 /
#      256 requests, uniform contexts against a mix of the same mean (100-1024 is the
#      standard's prompt draw; uniform points reach 90-96% in attention, the workload 72-77%
#      per batch bucket, job 13A), then the compare-eager table again with the fixed bench
#   H  (session 19) small_m_fused's launch swept per op on the 28-layer chain at 24 and 32
#      rows (72 launches x 3 ops, ~200 compiles: ~5 min), where its default loses to cuBLAS
#      (995 / 1,008 against 871 / 872 us, job 18A); a winner under 871 would let the model
#      take the fused layers (4 kernels a layer) to 32 rows: then TPOT b24/b32 A/B
#   E  host-bound v2,v1 with the fused layers (4 kernels a layer) for 17-256 rows, split or
#      not (take it after A's chain at 128 / 256 rows says they are near cuBLAS)
#   I  (session 19) fixed-size key partitions for mixed-context decode (attention.
#      DECODE_PARTITIONS): the GPU tests, then the standard workload per step and batch
#      bucket (scripts/standard_steps.py) with no rule / parts of 256 / of 512 keys / 4 equal
#      shares at 33-128 requests / and 2 at 129-256, ~8 min
#      Ran in session 19 on an H100 (VARIANTS=2, then p256 and a repeat of none by hand):
#      no rule won (standard_steps_parts-*_job19I-*.json), so J was not needed.
#   J  (session 19) a winner of I against no rule over fresh processes (standard), ~6 min
#   L  (session 20) small_m_resident (Gluon, weights in the MMA's registers before the PDL
#      wait): its GPU tests, the 28-layer chain against small_m_fused and cuBLAS at 4-64 rows
#      with a launch sweep at 32, the sync-debug loop with it on, then K's tests
#   M  (session 20; session 22's variants) TPOT at main's default (small_m_resident on, 3-32
#      rows) against small_m_fused's 3-16 (the default before) and the resident's 3-16 only,
#      fresh processes, one job
#   N  (session 20) the resident's GPU tests and chain, then M over 1 round if it beat
#      small_m_fused's at 16 rows (LIMIT = the call's seconds), then the sync-debug loop with
#      it on and the partition tests of K
#   O  (session 20) host-bound v2,v1 with the fused RoPE + attention kernel for decode steps of
#      up to 256 requests (decode_attention.MAX_TOKENS 32 -> 256; it lost at 256 in an older
#      tree, job D) against the default, fresh processes
#   P  (session 21) small_m_resident after d74f75d (the warps' sums through padded shared
#      memory: gl.reduce's lowering had 32-way bank conflicts, ~10 us a 16-row block at qkv)
#      and 3af3236 (warp slices of 32 keys): the per-op probe (scripts/probe_resident_kernels.py)
#      at 16-64 rows, then N without K's tests (they passed in job 21N). Run with
#      LIMIT=<the call's seconds - 60, the probe's> ROWS=4,16,32,64 SWEEP_ROWS= BATCHES=1,16,32
#   Q  (session 22) small_m_resident's LAUNCH_CANDIDATES (the per-op sweep's winners, jobs
#      22A-B) and BLOCK_M = 32: their GPU tests, the chain with a sweep at 16 / 32 rows, TPOT
#      against main's default (~8 min; if the candidates' tests pass and TPOT agrees, copy them
#      into LAUNCH / LAUNCH_OVER_16)
#   R  (session 23) where main stands, per kernel and per workload: the decode step's table at
#      the latency bench's batches (1-32 at 192 keys) and at 64 / 256 (96 keys), host-bound
#      v2,v1 and standard v2 (~6 min)
#   S  (session 23) does PDL overlap the resident kernels? (ptxas: qkv and gate_up take all
#      of an SM's registers, so the next kernel's programs only start on the SMs they leave
#      free) the chain with PDL on / off at 4 / 16 / 32 rows (the chain forces PDL on: its
#      runner ``resident`` is the one without; MRV2_PDL=0 changed nothing, job 23S); then TPOT at batch 24 / 32:
#      main (LAUNCH_OVER_16 adopted) / the launches before / attention in 1 split at 17-32
#      requests instead of 2 (~5 min)
#   T  (session 23) S's chain with its no-PDL runner, then main's decode-step table and TPOT at
#      batch 1-32 (after LAUNCH_OVER_16), ~4 min
#   U  (session 23) up to 16 rows, o_proj / down at BLOCK_N 32 (32 programs, 100 SMs left
#      free for gate_up / the next qkv) or 16 (64 programs, half an SM's registers) instead of
#      (8, 8): TPOT at batch 4 / 8 / 16, fresh processes (~3.5 min). U3=noprefetch="--set
#      $DA:PREFETCH=false" swaps the third variant for attention without its prefetch (qkv
#      takes every register of its SMs now, so attention's programs rarely start early)
#   V  (session 24) small_m_staged (the weights copied into shared memory before the wait,
#      half an SM's registers a program at most, so the next kernel's programs fit beside):
#      its GPU tests, the chain with all runners at 4-32 rows and a sweep of its launches at
#      SWEEP_ROWS (default 16), then, only if the tests passed, TPOT main / staged over fresh
#      processes at BATCHES (default 4,8,16,32), ~7 min
#   W  (session 24) small_m_staged on (MRV2_STAGED_GEMM=1; opt-in until these pass): its GPU
#      tests and the resident's, the model against transformers, the sync-debug loop, bench
#      latency, then R at main's default (~6 min). If the tests pass, make it the default.
#   X  (session 25) W's tests with small_m_staged on (MRV2_STAGED_GEMM=1) and the sync-debug
#      loop; the 28-layer chain at 16 / 24 / 32 rows: the resident against small_m_staged up to
#      32 rows with a program a 16-row block (SPLIT_ROWS) or one walking both, a sweep of the
#      split launches at SWEEP_ROWS (default none); TPOT over fresh processes (ROUNDS, default 1): resident / staged
#      to 16 rows / staged to 32 rows / and attention's keys prefetched into L2 before the wait
#      at 17+ requests (decode_attention.PREFETCH_L2) / at every batch (the tiles after
#      PREFETCH's first up to 16) / and attention in 1 split at 17-32 (no
#      merge kernel) at BATCHES (default 4,16,24,32), ~9 min
#   Y  (session 25) the figures and the book's in the order they are owed, each its own
#      JSON (a call cut short keeps the ones before): TPOT b1-32, host-bound v2,v1, standard,
#      then C's decode step times, attention and sampler (~7 min on an H200)
#   Z  (session 25, for later) fewer kernels a layer at 33-64 requests (b64 runs 294 kernels a step,
#      10.5 a layer: cuBLAS, norms, RoPE, SiLU, split-K reduce): the resident GEMMs
#      (small_m_resident.MODEL_MAX_M) and the fused RoPE + attention (decode_attention.MAX_TOKENS)
#      up to 64 rows, each and both, on bench decode b48 / b64 and the standard workload (fresh
#      processes, ROUNDS default 1), ~7 min
#   QKV (session 25, for later) TPOT b24 / b32 with qkv staged at 17-32 rows (small_m_staged.
#      KIND_MAX_M: attention's programs fit beside it), with and without attention's first-tile
#      prefetch up to 32 requests (fresh processes, ROUNDS default 1), ~2.5 min
#   NEXT (for session 29, in this order; sessions 27-28 got no H200, 28 no machine at all): Y
#      on an H200 (the book's figures at main's defaults; copy its JSON into benchmarks/results/
#      with git_commit set, then re-plot: the chapters pick the newest H200 JSON by what is
#      inside it,
#        jupyter nbconvert --to notebook --execute --inplace notebooks/0{1,5,8}_*.ipynb \
#          notebooks/10_*.ipynb && python scripts/make_clean_notebooks.py
#      ), then AF, AG (either GPU); AF2 only if a fold won in AF; then AT.
#   EM (session 26) attention's step metadata (request, lengths, the token's angles and slot)
#      loaded before the PDL wait and the new token's k / v beside q (attention.EARLY_META, on):
#      the attention GPU tests, the sync-debug loop, then bench decode at 1-32 (192 keys) and
#      64 / 256 (96 keys) and TPOT b1-32, on / off over fresh processes (ROUNDS, default 1), ~6 min
#   EM2 (session 26) EM's TPOT A/B over ROUNDS (default 3) rounds at BATCHES (default 1,4,24,32)
#   EM3 (session 26) TPOT b16-32: EARLY_META on / up to 16 requests in decode_attention / off,
#      and QKV's winner (qkv staged to 32 rows + attention prefetch to 32) with it on / to 16
#   EM4 (session 26) the new defaults' GPU tests and sync-debug loop, TPOT new / session 25's
#   PF (session 27) scripts/probe_weight_stream_chain.py with each kernel also bringing the
#      weights of the kernel 1 or 2 later into the L2 (prefetch.global.L2 lines, or
#      cp.async.bulk.prefetch.L2 chunks): does a stream paced by its own kernels beat the ~55%
#      of the bandwidth the plain chain reaches? (~1 min)
#   AG (session 27, not yet run) why attention in the model reads its KV at ~77-79% of the
#      H200's copy bandwidth (job 13A: 256 requests x 768 keys, 6.9 ms a step for 5.46 at the
#      bandwidth; the standard workload's decode lives there) when the same kernel alone reaches
#      96% (bench_attention, 256 x 1,024, randomly permuted pages): the kernel alone, then bench
#      decode at 256 x 768 / 1,024 with main's defaults, with PDL off, and with the longest-first
#      order off (per-layer attention us against the lone kernel's), ~4 min. Offline (session
#      28, Triton 3.6): the b256 launch compiles to 242 registers and 38 KB of shared memory
#      with PDL, EARLY_META and the order each on or off (the PTX differs by 2-7 lines), so
#      the gap is not the model's variant of the code; AG also logs clocks and power
#   AF (session 28, not yet run) folded KV heads (attention_table.fold_rows: kv_fold heads of a
#      request in one program, reading each token's heads as one contiguous run, the metadata
#      and page numbers once; 2,048 -> 256-1,024 programs at batch 256): the fold GPU tests,
#      the isolated sweep (the table's launch against folds of 2 / 4 / 8 at 64-256 requests and
#      128-1,024 keys, then at mixed contexts: --spread 0.9), then bench decode in the model at
#      256 x 96 / 768 with the sweep's fastest fold at 256 x 128 and at 256 x 1,024 against
#      main's launch (~8 min)
#   AF2 (session 28) the standard and host-bound workloads with AF's winner (FOLD='<the JSON
#      of its --paged-launch>') against main, fresh processes (~5 min)
#   AT (session 27) the fused RoPE + attention kernel for decode steps of up to 48 / 64 tokens
#      (decode_attention.MAX_TOKENS; job 27Z: -3.3% decode GPU ms at b48, flat at b64): bench
#      decode b40 / b48, then the standard workload, fresh processes (~4 min)
#   K  (session 20) the GPU tests of 3c07654's split_key_range helper, then the decode step's
#      per-kernel table at the latency bench's batches (1-32 at 192 keys) and at 64 / 256 (96
#      keys, the host-bound shape), then H
set -uo pipefail
part=${1:?part A-Z or QKV}
export PYTHONPATH=$PWD MRV2_SHARED_DATA=$PWD/.carry/data PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SM=mrv2.kernels.small_m_fused
RS=mrv2.kernels.small_m_resident
DA=mrv2.kernels.decode_attention
AT=mrv2.kernels.attention
py() { python3 "$@" 2>&1 | tee -a "$OUT/log_$part.txt"; }
case $part in
A)
  py -m pytest -q -x tests/test_small_m_split_k.py tests/test_small_m_fused.py
  MRV2_SMALL_M_SPLIT_K=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  py scripts/bench_skinny_fused.py --rows 4,8,16,24,32,64,128,256 --pdl --split-k \
     --out "$OUT/small_m_split_chain.json"
  py scripts/bench_processes.py --rounds 2 --out "$OUT/bench_latency_split_processes.json" \
     --variant default= \
     --variant split="--set $SM:SPLIT_K=true" \
     --variant split32="--set $SM:SPLIT_K=true --set $SM:MODEL_MAX_M=32" \
     -- bench latency --runner v2 --batch-sizes 4,8,16,24,32
  ;;
B)
  py -m pytest -q -x tests/test_kernels_attention.py tests/test_decode_heads.py
  DH=mrv2.kernels.decode_heads
  for v in "default=" "one-loop=--set $AT:DECODE_ONE_LOOP=true" \
           "heads8=--set $DH:ENABLED=true" "heads2=--set $DH:ENABLED=true --set $DH:HEADS=2" \
           "bn32w4=--paged-launch {\"lo\":33,\"hi\":1024,\"block_n\":32,\"num_warps\":4}"; do
    name=${v%%=*}; args=${v#*=}
    py scripts/bench_with.py $args -- bench decode --batch-sizes 256 --contexts 96 \
      --max-model-len 256 --out "$OUT/bench_decode_b256_$name.json"
  done
  py scripts/bench_processes.py --rounds 2 --out "$OUT/bench_hostbound_attention.json" \
     --variant default= --variant heads8="--set $DH:ENABLED=true" \
     -- bench throughput --workload host-bound --runner v2,v1
  ;;
D)
  py scripts/bench_processes.py --rounds 2 --out "$OUT/bench_latency_prefetch_reqs.json" \
     --variant reqs8= --variant reqs16="--set $DA:PREFETCH_MAX_REQS=16" \
     --variant reqs32="--set $DA:PREFETCH_MAX_REQS=32" \
     -- bench latency --runner v2 --batch-sizes 16,24,32
  ;;
C)
  py scripts/bench_attention.py --out "$OUT/attention_decode.json"
  py scripts/bench_sampler.py --out "$OUT/sampler.json"
  py -m mrv2 bench decode --compare-eager --out "$OUT/decode_steps.json"
  py -m mrv2 bench throughput --workload standard --runner v2 --out "$OUT/bench_standard.json"
  py -m mrv2 bench latency --runner v2 --batch-sizes 1,4,8,16,32 --out "$OUT/bench_latency.json"
  ;;
E)
  py scripts/bench_processes.py --rounds 2 --out "$OUT/bench_hostbound_fused_layers.json" \
     --variant default= --variant fused256="--set $SM:MODEL_MAX_M=256" \
     --variant fused256split="--set $SM:MODEL_MAX_M=256 --set $SM:SPLIT_K=true" \
     -- bench throughput --workload host-bound --runner v2,v1
  ;;
F)
  py -m pytest -q tests/test_decode_heads.py
  py -m mrv2 bench throughput --workload standard --runner v2 --timeline \
     --out "$OUT/bench_standard_timeline.json"
  bash "$0" D
  ;;
G)
  py -m mrv2 bench decode --batch-sizes 64,128,256 --contexts 562,100-1024,1024,200-1848 \
     --out "$OUT/decode_steps_mixed.json"
  py -m mrv2 bench decode --batch-sizes 1,64,256 --contexts 128 --compare-eager \
     --out "$OUT/decode_steps.json"
  ;;
H)
  py scripts/bench_skinny_fused.py --rows 24,32 --pdl --launch-sweep \
     --out "$OUT/small_m_launch_sweep.json"
  ;;
I)
  py -m pytest -q tests/test_kernels_attention.py -k "partition or bf16 or cuda" \
     tests/test_decode_attention.py tests/test_gpu_async.py::test_fixed_key_partitions_without_a_sync_or_a_change
  AP=mrv2.kernels.attention:DECODE_PARTITIONS
  for v in "none=[]" \
           "eq4=[{\"lo\":33,\"hi\":128,\"min_seq_len\":1024,\"num_splits\":4}]" \
           "p256=[{\"lo\":5,\"hi\":256,\"min_seq_len\":1024,\"keys\":256}]" \
           "eq42=[{\"lo\":33,\"hi\":128,\"min_seq_len\":1024,\"num_splits\":4},{\"lo\":129,\"hi\":256,\"min_seq_len\":1024,\"num_splits\":2}]" \
           "p512=[{\"lo\":5,\"hi\":256,\"min_seq_len\":1024,\"keys\":512}]"; do
    name=${v%%=*}; rule=${v#*=}
    py scripts/standard_steps.py --set "$AP=$rule" --out "$OUT/standard_steps_$name.json"
    n=$((${n:-0} + 1)); [ "$n" -ge "${VARIANTS:-5}" ] && break   # VARIANTS=3: the first 3
  done
  ;;
J)
  RULE=${RULE:?RULE=the DECODE_PARTITIONS JSON to A/B}
  py scripts/bench_processes.py --rounds ${ROUNDS:-3} --out "$OUT/bench_standard_partitions.json" \
     --variant none="--set mrv2.kernels.attention:DECODE_PARTITIONS=[]" \
     --variant parts="--set 'mrv2.kernels.attention:DECODE_PARTITIONS=$RULE'" \
     -- bench throughput --workload standard --runner v2
  ;;
L)
  py -m pytest -q tests/test_small_m_resident.py
  py scripts/bench_resident_chain.py --rows 4,8,16,24,32,48,64 --sweep "${SWEEP_ROWS-32}" \
     --out "$OUT/resident_chain.json"
  MRV2_RESIDENT_GEMM=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  py -m pytest -q tests/test_kernels_attention.py -k "partition or bf16 or cuda" \
     tests/test_decode_attention.py tests/test_gpu_async.py::test_fixed_key_partitions_without_a_sync_or_a_change
  ;;
M)
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_latency_resident_processes.json" \
     --variant default= --variant fused16="--set $RS:ENABLED=false" \
     --variant resident16="--set $RS:MODEL_MAX_M=16" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-1,4,8,16,24,32}
  ;;
N)
  py -m pytest -q tests/test_small_m_resident.py
  py scripts/bench_resident_chain.py --rows ${ROWS:-4,8,16,24,32,48,64} --sweep "${SWEEP_ROWS-32}" \
     --out "$OUT/resident_chain.json"
  if python3 -c "import json,sys; c={(r['M'],r['runner']):r['us_per_step'] for r in json.load(open('$OUT/resident_chain.json'))['chain']}; sys.exit(0 if c[(16,'resident_pdl')] < c[(16,'fused_pdl')] else 1)"; then
    ROUNDS=1 timeout $((${LIMIT:-570} - 100 - SECONDS)) bash "$0" M   # leave ~100 s for the tests below
  else echo "resident lost at 16 rows: no TPOT run"; fi
  MRV2_RESIDENT_GEMM=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  [ -n "${NOPART:-}" ] && exit 0   # K's partition tests (they passed in job 21N)
  py -m pytest -q tests/test_kernels_attention.py tests/test_decode_attention.py -k "partition or bf16 or cuda or gpu" \
     tests/test_gpu_async.py::test_fixed_key_partitions_without_a_sync_or_a_change
  ;;
P)
  py scripts/probe_resident_kernels.py --rows 16,17,32,33,64 --out "$OUT/resident_kernels.json"
  NOPART=1 bash "$0" N
  ;;
Q)
  # The GPU tests of the resident at LAUNCH_CANDIDATES and BLOCK_M = 32 and of the model
  # against transformers, the chain and a sweep at 16 / 32 rows (BLOCK_M too), then TPOT:
  # main's default (the resident, 3-32 rows) against the candidates and small_m_fused's 3-16.
  py -m pytest -q tests/test_small_m_resident.py tests/test_gpu_qwen3.py
  py scripts/bench_resident_chain.py --rows 4,16,24,32,48,64 --sweep "${SWEEP_ROWS-16,32}" \
     --out "$OUT/resident_chain.json"
  CAND="--set '$RS:LAUNCH={\"norm\":[32,16,16],\"add\":[8,8,16],\"gate_up\":[32,8,16]}'"
  CAND="$CAND --set '$RS:LAUNCH_OVER_16={\"norm\":[32,16,16],\"add\":[32,8,16],\"gate_up\":[32,8,16]}'"
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_latency_resident_cand_processes.json" \
     --variant default= --variant candidates="$CAND" --variant fused16="--set $RS:ENABLED=false" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-1,4,8,16,24,32}
  ;;
O)
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_hostbound_fused_attention.json" \
     --variant default= --variant fused256="--set $DA:MAX_TOKENS=256" \
     -- bench throughput --workload host-bound --runner v2,v1
  ;;
R)
  py -m mrv2 bench decode --batch-sizes 1,4,16,32 --contexts 192 --max-model-len 256 \
     --out "$OUT/decode_steps_latency_shape.json"
  py -m mrv2 bench decode --batch-sizes 64,256 --contexts 96 --max-model-len 256 \
     --out "$OUT/decode_steps_hostbound_shape.json"
  py -m mrv2 bench throughput --workload host-bound --runner v2,v1 --out "$OUT/bench_host-bound.json"
  py -m mrv2 bench throughput --workload standard --runner v2 --out "$OUT/bench_standard.json"
  ;;
S)
  py scripts/bench_resident_chain.py --rows 4,16,32 --out "$OUT/resident_chain_pdl.json"
  OLD="--set '$RS:LAUNCH_OVER_16={\"norm\":[32,16,16],\"add\":[8,8,16],\"gate_up\":[32,16,16]}'"
  ONE="--decode-launch '{\"lo\":17,\"hi\":32,\"num_splits\":1,\"block_n\":64}'"
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_latency_over16_processes.json" \
     --variant default= --variant before="$OLD" --variant attn1split="$ONE" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-24,32}
  ;;
T)
  py scripts/bench_resident_chain.py --rows 4,16,32 --out "$OUT/resident_chain_pdl.json"
  py -m mrv2 bench decode --batch-sizes 1,4,16,32 --contexts 192 --max-model-len 256 \
     --out "$OUT/decode_steps_latency_shape.json"
  py -m mrv2 bench latency --runner v2 --batch-sizes 1,4,8,16,24,32 --out "$OUT/bench_latency.json"
  ;;
U)
  A32="--set '$RS:LAUNCH={\"norm\":[32,16,16],\"add\":[32,8,16],\"gate_up\":[32,16,16]}'"
  A16="--set '$RS:LAUNCH={\"norm\":[32,16,16],\"add\":[16,8,16],\"gate_up\":[32,16,16]}'"
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_latency_add16_processes.json" \
     --variant default= --variant add32x8="$A32" --variant "${U3:-add16x8=$A16}" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-4,8,16}
  ;;
V)
  py -m pytest -q tests/test_small_m_staged.py; tests_rc=$?
  MRV2_STAGED_GEMM=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  py scripts/bench_resident_chain.py --rows ${ROWS:-4,8,16} --sweep "${SWEEP_ROWS-4,16}" \
     --sweep-runner staged_pdl --out "$OUT/staged_chain.json"
  if [ "$tests_rc" = 0 ]; then
    py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_latency_staged_processes.json" \
       --variant default= --variant staged="--set mrv2.kernels.small_m_staged:ENABLED=true" \
       -- bench latency --runner v2 --batch-sizes ${BATCHES:-4,8,16}
  fi
  ;;
W)
  MRV2_STAGED_GEMM=1 py -m pytest -q tests/test_small_m_staged.py tests/test_small_m_resident.py tests/test_gpu_qwen3.py
  py -m pytest -q tests/test_decode_attention.py -k "l2 or gpu_bf16"
  MRV2_STAGED_GEMM=1 MRV2_ATTENTION_PREFETCH_L2=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  MRV2_STAGED_GEMM=1 py -m mrv2 bench latency --runner v2 --batch-sizes 1,4,8,16,24,32 --out "$OUT/bench_latency_staged.json"
  bash "$0" R
  ;;
X)
  MRV2_STAGED_GEMM=1 py -m pytest -q tests/test_small_m_staged.py tests/test_small_m_resident.py tests/test_gpu_qwen3.py
  py -m pytest -q tests/test_decode_attention.py -k "l2 or gpu_bf16"
  MRV2_STAGED_GEMM=1 MRV2_ATTENTION_PREFETCH_L2=1 py -m pytest -q tests/test_gpu_async.py -k sync_debug
  py scripts/bench_resident_chain.py --rows 16,24,32 --out "$OUT/staged32_chain.json" \
     --runners fused_pdl,resident_pdl,staged_pdl,staged32_pdl,staged32_walk_pdl \
     --sweep "${SWEEP_ROWS:-}" --sweep-runner staged32_pdl
  ONE="--decode-launch '{\"lo\":17,\"hi\":32,\"num_splits\":1,\"block_n\":64}'"
  ST=mrv2.kernels.small_m_staged
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_latency_staged32_processes.json" \
     --variant resident= --variant staged="--set $ST:ENABLED=true" \
     --variant staged32="--set $ST:ENABLED=true --set $ST:MAX_M=32" \
     --variant staged32l2="--set $ST:ENABLED=true --set $ST:MAX_M=32 --set $DA:PREFETCH_L2=true" \
     --variant staged32l2all="--set $ST:ENABLED=true --set $ST:MAX_M=32 --set $DA:PREFETCH_L2=true --set $DA:PREFETCH_L2_MIN_REQS=1" \
     --variant staged32l2one="--set $ST:ENABLED=true --set $ST:MAX_M=32 --set $DA:PREFETCH_L2=true $ONE" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-4,16,24,32}
  ;;
Y)
  py -m mrv2 bench latency --runner v2 --batch-sizes 1,4,8,16,32 --out "$OUT/bench_latency.json"
  py -m mrv2 bench throughput --workload host-bound --runner v2,v1 --out "$OUT/bench_host-bound.json"
  py -m mrv2 bench throughput --workload standard --runner v2 --out "$OUT/bench_standard.json"
  py -m mrv2 bench decode --compare-eager --out "$OUT/decode_steps.json"
  py scripts/bench_attention.py --out "$OUT/attention_decode.json"
  py scripts/bench_sampler.py --out "$OUT/sampler.json"
  ;;
Z)
  G64="--set $RS:MODEL_MAX_M=64"; A64="--set $DA:MAX_TOKENS=64"
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/decode_steps_64rows_processes.json" \
     --variant default= --variant gemm64="$G64" --variant attn64="$A64" --variant both64="$G64 $A64" \
     -- bench decode --batch-sizes 48,64 --contexts 192 --max-model-len 256
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_standard_64rows_processes.json" \
     --variant default= --variant both64="$G64 $A64" -- bench throughput --workload standard --runner v2
  ;;
EM)
  py -m pytest -q tests/test_decode_attention.py tests/test_kernels_attention.py tests/test_pdl.py
  py -m pytest -q tests/test_gpu_async.py -k sync_debug
  OFF="--set $AT:EARLY_META=false"
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/decode_steps_early_meta_processes.json" \
     --variant on= --variant off="$OFF" \
     -- bench decode --batch-sizes 1,4,16,32 --contexts 192 --max-model-len 256
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/decode_steps_hostbound_early_meta_processes.json" \
     --variant on= --variant off="$OFF" \
     -- bench decode --batch-sizes 64,256 --contexts 96 --max-model-len 256
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_latency_early_meta_processes.json" \
     --variant on= --variant off="$OFF" -- bench latency --runner v2 --batch-sizes 1,4,16,24,32
  ;;
EM2)
  # EM's latency A/B again over more processes (one round's b24 / b32 said off, b1 said on)
  py scripts/bench_processes.py --rounds ${ROUNDS:-3} --out "$OUT/bench_latency_early_meta_rounds_processes.json" \
     --variant on= --variant off="--set $AT:EARLY_META=false" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-1,4,24,32}
  ;;
EM3)
  # which of EARLY_META's pieces costs at 17-32 requests, and with qkv staged to 32 rows and
  # attention's first tile prefetched (QKV's winner) instead
  ST=mrv2.kernels.small_m_staged
  QKV="--set '$ST:KIND_MAX_M={\"norm\":32}' --set '$ST:SPLIT_ROWS={\"norm\":false,\"add\":true,\"gate_up\":true}' --set $DA:PREFETCH_MAX_REQS=32"
  M16="--set $DA:EARLY_META_MAX_REQS=16"
  py scripts/bench_processes.py --rounds ${ROUNDS:-2} --out "$OUT/bench_latency_early_meta_17_32_processes.json" \
     --variant on= --variant meta16="$M16" --variant off="--set $AT:EARLY_META=false" \
     --variant qkv32pf="$QKV" --variant qkv32pf_meta16="$QKV $M16" \
     -- bench latency --runner v2 --batch-sizes ${BATCHES:-16,24,32}
  ;;
PF)
  py scripts/probe_weight_stream_chain.py --blocks 4096,8192 --prefetch line,bulk --ahead 1,2 \
     --out "$OUT/probe_weight_stream_prefetch.json"
  ;;
AF)
  py -m pytest -q tests/test_attention_fold.py tests/test_gpu_async.py -k "fold"
  py scripts/sweep_decode_attention.py --fold --batches 256,128,64 --contexts 128,512,1024 \
     --max-seconds 200 --out "$OUT/attention_decode_sweep_fold.json"
  # the same at mixed contexts (0.1x-1.9x the point's; a fold makes a long request's program
  # kv_fold times longer, which a uniform batch never shows)
  py scripts/sweep_decode_attention.py --fold --spread 0.9 --batches 256,128 --contexts 96,768 \
     --max-seconds 100 --out "$OUT/attention_decode_sweep_fold_mixed.json"
  # the in-model launches: the sweep's fastest fold at 256 x 128 and at 256 x 1,024 (offline
  # guesses if the sweep did not get there: 16 keys x 8 warps x 3 stages, whose page loads
  # are cp.async too; 2 stages loads them synchronously, PTX)
  best() { python3 -c 'import json, sys
pts = [p for p in json.load(open(sys.argv[1]))["points"]
       if (p["batch"], p["context"]) == (256, int(sys.argv[2]))]
t = min((t for p in pts for t in p["timings"] if t.get("kv_fold", 1) > 1), key=lambda t: t["us"])
print(json.dumps({"lo": 64, "hi": 512, **{k: t[k] for k in ("kv_fold", "block_n", "num_warps",
                  "num_stages", "num_splits")}}))' "$OUT/attention_decode_sweep_fold.json" $1 2>/dev/null \
    || echo "$2"; }
  FS=$(best 128 '{"lo":64,"hi":512,"kv_fold":8,"block_n":16,"num_warps":8,"num_stages":3}')
  FL=$(best 1024 '{"lo":64,"hi":512,"kv_fold":2,"block_n":16,"num_warps":8,"num_stages":3}')
  echo "in-model folds: short $FS, long $FL" | tee -a "$OUT/log_$part.txt"
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/decode_steps_fold_processes.json" \
     --variant default= --variant fold_short="--paged-launch '$FS'" --variant fold_long="--paged-launch '$FL'" \
     -- bench decode --batch-sizes 256 --contexts 96,768 --max-model-len 1280
  ;;
AF2)
  for wl in host-bound standard; do
    py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_${wl}_fold_processes.json" \
       --variant default= --variant fold="--paged-launch '${FOLD:?set FOLD to the JSON of the AF winner}'" \
       -- bench throughput --workload $wl --runner v2
  done
  ;;
AG)
  # the SM / memory clocks, power and temperature every 200 ms through the part (is the
  # model's attention slower than the lone kernel's because the GPU runs slower there?)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
     --format=csv -lms 200 > "$OUT/ag_clocks.csv" 2>&1 & SMI=$!
  py scripts/bench_attention.py --no-ref --out "$OUT/attention_decode_alone.json"
  DEC="bench decode --batch-sizes 256 --contexts 768,1024 --max-model-len 1280"
  py -m mrv2 $DEC --out "$OUT/decode_steps_b256_long.json"
  MRV2_PDL=0 py -m mrv2 $DEC --out "$OUT/decode_steps_b256_long_pdl-off.json"
  MRV2_ATTENTION_ORDER=0 py -m mrv2 $DEC --out "$OUT/decode_steps_b256_long_order-off.json"
  MRV2_ATTENTION_EARLY_META=0 py -m mrv2 $DEC --out "$OUT/decode_steps_b256_long_meta-off.json"
  kill $SMI 2>/dev/null
  ;;
AT)
  A48="--set $DA:MAX_TOKENS=48"
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/decode_steps_attn48_processes.json" \
     --variant default= --variant attn48="$A48" --variant attn64="--set $DA:MAX_TOKENS=64" \
     -- bench decode --batch-sizes 40,48 --contexts 192 --max-model-len 256
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_standard_attn48_processes.json" \
     --variant default= --variant attn48="$A48" -- bench throughput --workload standard --runner v2
  ;;
EM4)
  # the new defaults (EARLY_META off at 17-32 decode requests, qkv staged to 32 rows, attention's
  # first tile prefetched to 32): the GPU tests, the model against transformers, the sync-debug
  # loop, then TPOT against session 25's defaults (all of EARLY_META off, qkv staged to 16)
  py -m pytest -q tests/test_small_m_staged.py tests/test_decode_attention.py tests/test_gpu_qwen3.py
  py -m pytest -q tests/test_gpu_async.py -k sync_debug
  ST=mrv2.kernels.small_m_staged
  OLD="--set $AT:EARLY_META=false --set $ST:KIND_MAX_M={} --set $DA:PREFETCH_MAX_REQS=16"
  [ "${TPOT:-1}" = 0 ] || py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_latency_session26_defaults_processes.json" \
     --variant new= --variant s25="$OLD" -- bench latency --runner v2 --batch-sizes 1,4,16,24,32
  ;;
QKV)
  # qkv staged at 17-32 rows (one program walks both blocks: half an SM) so attention's programs
  # fit beside it before the wait, alone and with attention's first tile prefetched up to 32
  ST=mrv2.kernels.small_m_staged
  QKV="--set '$ST:KIND_MAX_M={\"norm\":32}' --set '$ST:SPLIT_ROWS={\"norm\":false,\"add\":true,\"gate_up\":true}'"
  py scripts/bench_processes.py --rounds ${ROUNDS:-1} --out "$OUT/bench_latency_qkv_staged32_processes.json" \
     --variant default= --variant qkv32="$QKV" --variant qkv32pf="$QKV --set $DA:PREFETCH_MAX_REQS=32" \
     -- bench latency --runner v2 --batch-sizes 24,32
  ;;
K)
  py -m pytest -q tests/test_kernels_attention.py -k "partition or bf16 or cuda" \
     tests/test_decode_attention.py tests/test_gpu_async.py::test_fixed_key_partitions_without_a_sync_or_a_change
  py -m mrv2 bench decode --batch-sizes 1,4,16,32 --contexts 192 --max-model-len 256 \
     --out "$OUT/decode_steps_latency_shape.json"
  py -m mrv2 bench decode --batch-sizes 64,256 --contexts 96 --max-model-len 256 \
     --out "$OUT/decode_steps_hostbound_shape.json"
  bash "$0" H
  ;;
*) echo "unknown part $part (A-Z, QKV, EM, EM2, EM3, EM4, PF, AF, AF2, AG, AT)"; exit 2 ;;
esac
