#!/usr/bin/env bash
# The GPU benchmark run: the peers (bench/peers_gpu.py) and t2t's train and decode speed in the
# same run on the same GPU, then a table of t2t/peer ratios. A user runs it on a GPU machine from
# the repository root:
#
#   bash bench/run_gpu.sh          # on the GPU machine (bench/README.md)
#   bash bench/run_gpu.sh prepare  # on a checkout, before copying the tree to a machine without
#                                  # git: notes the commit in shared/bench/t2t_commit.txt (git
#                                  # ignores shared/) for the run's header
#   bash bench/run_gpu.sh --tiny   # CPU smoke test of the t2t part and the summary (no peers)
#
# Everything lands in $OUT (default /tmp/t2t-bench-<time>), 7 files at most: run_gpu.log,
# anchors.jsonl + <section>.stderr.log (peers), t2t_results.jsonl and summary.md. Time: BUDGET_S
# (default 480) for the whole run, PEER_BUDGET_S (default 230) of it for the peers; each t2t part
# is cut at its own cap and at the overall deadline, least important last.
# Knobs (environment): PYTHON, BUDGET_S, PEER_BUDGET_S, MODELS (base|big|both), PEER_SECTIONS
# (default hw,hf,torch; the jax section needs flax examples/wmt in .peer/flax_wmt and about
# 150 s more), LEVERS (train_speed.py options of every t2t train run; default scanned layers, rbg
# dropout keys, fused loss in chunks of 32 positions: "--scan_layers --rng_impl rbg
# --loss_chunk_len 32"), REMAT (remat policy of the last run, default dots_saveable), CAP_SCALE
# (every part's cap times this, default 1: a --tiny run on a loaded CPU needs several times the
# caps sized for a GPU, e.g. CAP_SCALE=6 BUDGET_S=3600).
set -u
cd "$(dirname "$0")/.."

if [[ "${1:-}" == prepare ]]; then
    mkdir -p shared/bench
    commit=$(git rev-parse HEAD)
    if ! git diff-index --quiet HEAD -- || [[ -n $(git ls-files --others --exclude-standard) ]]
    then commit="$commit+uncommitted-changes"; fi
    echo "$commit" > shared/bench/t2t_commit.txt
    echo "prepared shared/bench/t2t_commit.txt: $commit"
    exit 0
fi

TINY=""
[[ "${1:-}" == --tiny ]] && TINY=--tiny
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/t2t-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run_gpu.log") 2>&1
if [[ -n $TINY ]]; then
    export JAX_PLATFORMS=cpu
    BUDGET_S=${BUDGET_S:-300}
    PEER_SECTIONS=${PEER_SECTIONS:-}  # peers --tiny needs torch and takes minutes: only on request
    MODELS=${MODELS:-base}  # keep the CPU smoke test short
else
    BUDGET_S=${BUDGET_S:-480}
    PEER_SECTIONS=${PEER_SECTIONS-hw,hf,torch}
    MODELS=${MODELS:-both}
fi
PEER_BUDGET_S=${PEER_BUDGET_S:-230}
LEVERS=${LEVERS:---scan_layers --rng_impl rbg --loss_chunk_len 32}
REMAT=${REMAT:-dots_saveable}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }

# prepare's note first: it also says whether the tree had uncommitted changes
commit=$(cat shared/bench/t2t_commit.txt 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo '?')
echo "# run_gpu.sh $(date -u +%FT%TZ) commit=$commit budget=${BUDGET_S}s tiny=${TINY:-no}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader \
    2>/dev/null || echo "# no nvidia-smi"

$PY -c 'import jax; print("# jax", jax.__version__, jax.devices())' || exit 1

# run_capped CAP NAME CMD...: runs CMD under min(CAP, time left); records a skip or a timeout as a
# RESULT line in t2t_results.jsonl so that the summary shows what is missing and why.
record() {  # record NAME STATUS REASON
    printf '{"section": "t2t", "name": "%s", "status": "%s", "reason": "%s"}\n' "$1" "$2" "$3" \
        >> "$OUT/t2t_results.jsonl"
}
run_capped() {
    local cap=$(( $1 * ${CAP_SCALE:-1} )) name=$2 limit
    shift 2
    limit=$(( cap < $(left) ? cap : $(left) ))
    if (( limit < 30 )); then
        echo "# $name: skipped, ${limit}s left"
        record "$name" skipped "budget: ${limit}s left"
        return
    fi
    echo "# $name: cap ${limit}s: $*"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "# $name: rc=$rc after $(( $(date +%s) - t0 ))s"
    if (( rc == 124 || rc == 137 )); then
        record "$name" timeout "killed at its cap of ${limit}s"
    fi
}

# 1. Peers, first: their hw section measures the matmul peak that becomes t2t's second MFU base.
if [[ -n $PEER_SECTIONS ]]; then
    run_capped $((PEER_BUDGET_S + 60)) peers \
        env ANCHOR_BUDGET_S="$PEER_BUDGET_S" \
        $PY bench/peers_gpu.py --sections "$PEER_SECTIONS" $TINY
    MEAS_TFLOPS=$($PY -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["name"] == "matmul_bf16" and r["status"] == "ok": print(r["achieved_tflops"])' \
        "$OUT/anchors.jsonl" 2>/dev/null | tail -1)
    [[ -n $MEAS_TFLOPS ]] && export MEAS_TFLOPS
fi

# 2. t2t, in order of importance: the shipped configs' attention (dot_product) for both models with
# the speed levers ($LEVERS), then decoding (both attention implementations), then training with
# cuDNN flash attention (attention_impl='cudnn': sequence lengths + the causal flag, no dense mask;
# never run on a GPU before this script's first run: it may fail, and the table then says so),
# then BIG with rematerialization ($REMAT: memory for speed; least important).
# shellcheck disable=SC2086  # LEVERS is a list of options
run_capped 170 t2t_train_dot_product \
    $PY bench/train_speed.py --model "$MODELS" --attention dot_product $LEVERS $TINY
run_capped 80 t2t_decode $PY bench/decode_speed.py --attention dot_product,xla $TINY
# The GPU dry run against the card: base (64 x 256, bf16) compiled deviceless on the CPU backend as
# on a laptop, then compiled and run on the card: memory, step time, tokens/s and MFU side by side
# (bench/aot_check.py; its deviceless compile is a CPU-bound minute or two).
run_capped 200 t2t_aot_check $PY bench/aot_check.py $TINY
CUDNN=cudnn; [ -n "$TINY" ] && CUDNN=xla  # no cuDNN on a CPU smoke run
# shellcheck disable=SC2086
run_capped 150 t2t_train_cudnn \
    $PY bench/train_speed.py --model "$MODELS" --attention $CUDNN $LEVERS $TINY
# shellcheck disable=SC2086
run_capped 90 t2t_train_remat \
    $PY bench/train_speed.py --model big --attention $CUDNN $LEVERS --remat "$REMAT" $TINY

# 3. Summary: t2t / peer ratios from this run, and against the peers' published H200 run.
$PY - "$OUT" "$commit" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys

out, commit = sys.argv[1], sys.argv[2]

def load(name):
    path = os.path.join(out, name)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []

peers, t2t = load("anchors.jsonl"), load("t2t_results.jsonl")
ok = lambda recs: [r for r in recs if r.get("status") == "ok"]
info = next((r for r in ok(peers) if r["name"] == "device_info"), {})
hw = {r["name"]: r for r in ok(peers)}
# the peers' reference run (bench/RESULTS.md; 2026-11-29, one H200): NOT from this run
PUBLISHED = {"train_BASE": {"torch": 641000, "flax wmt": 442200},
             "train_BIG": {"torch": 296200, "flax wmt": 217700},
             "beam_search_BASE": {"flax wmt": 81.3, "hf marian": 339.3}}
fmt = lambda v, f="{:.3g}": "" if v is None else f.format(v)

print(f"## run_gpu.sh summary (commit {commit})")
device = info.get("gpu") or next((r["device"] for r in t2t if r.get("device")), "?")
print(f"device: {device}, "
      f"torch {info.get('torch', '-')}, {next((r['version'] for r in t2t if 'version' in r), '')}")
if "matmul_bf16" in hw:
    print(f"bf16 matmul {hw['matmul_bf16']['achieved_tflops']} TFLOP/s, "
          f"copy {hw.get('copy_d2d', {}).get('gbs_median', '?')} GB/s")

peer_train = {}
for r in ok(peers):
    if r["name"].startswith("train_"):
        label = "torch" if r["section"] == "torch" else "flax wmt"
        peer_train.setdefault(r["name"], {})[label] = r
print("\n### training (128 x 256 pairs, vocab 32768, bf16); ratio = t2t tok/s / peer tok/s")
print("| t2t | levers | status | step ms | tgt tok/s | MFU@989 | MFU@meas | compile s "
      "| vs torch (this run) | vs flax wmt (this run) | vs torch (published) "
      "| vs flax wmt (published) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in t2t:
    if not r["name"].startswith(("train_", "t2t_train")):
        continue
    key = "_".join(r["name"].split("_")[:2])  # train_BASE_xla -> train_BASE
    tok = r.get("tgt_tok_s")
    here = peer_train.get(key, {})
    # the published numbers are for the full shape only (not --tiny or other sizes)
    pub = PUBLISHED.get(key, {}) if (r.get("batch"), r.get("seq"), r.get("vocab")) == (
        128, 256, 32768) else {}
    ratio = lambda p: fmt(tok / p, "{:.2f}x") if tok and p else ""
    levers = " ".join(f"{k}={r[k]}" for k in ("remat", "scan_layers", "rng_impl",
                                               "loss_chunk_len") if k in r)
    cells = [r["name"], levers, r["status"], fmt(r.get("step_ms"), "{:.1f}"),
             fmt(tok, "{:,.0f}"),
             fmt(r.get("mfu"), "{:.1%}"), fmt(r.get("mfu_measured_peak"), "{:.1%}"),
             fmt(r.get("compile_s"), "{:.0f}"),
             ratio(here.get("torch", {}).get("tgt_tok_s")),
             ratio(here.get("flax wmt", {}).get("tgt_tok_s")),
             ratio(pub.get("torch")), ratio(pub.get("flax wmt"))]
    print("| " + " | ".join(map(str, cells)) + " |" + (f" {r.get('error') or r.get('reason')}"
                                                        if r["status"] != "ok" else ""))
for key, by in sorted(peer_train.items()):
    for label, r in by.items():
        print(f"| peer {label} {key} | | ok | {fmt(r['step_ms'], '{:.1f}')} | "
              f"{fmt(r['tgt_tok_s'], '{:,.0f}')} | {fmt(r.get('mfu_989'), '{:.1%}')} | "
              f"{fmt(r.get('mfu_measured_peak'), '{:.1%}')} | {fmt(r.get('compile_s'), '{:.0f}')} "
              "| | | | |")

print("\n### beam search (BASE, beam 4, 64 x 32 source tokens, 64 new tokens forced); "
      "ratio = peer ms / t2t ms (> 1: t2t faster)")
print("| t2t | status | batch ms | sent/s | compile s | vs hf marian (this run) "
      "| vs flax wmt (this run) | vs flax wmt (published) | vs hf marian (published) |")
print("|---|---|---|---|---|---|---|---|---|")
peer_dec = {("hf marian" if r["section"] == "hf" else "flax wmt"): r for r in ok(peers)
            if r["name"] in ("generate_BASE", "beam_search_BASE")}
for r in t2t:
    if not (r["name"].startswith("beam_search") or r["name"] == "t2t_decode"):
        continue
    ms = r.get("batch_ms")
    ratio = lambda p: fmt(p / ms, "{:.2f}x") if ms and p else ""
    full = (r.get("batch"), r.get("src_len"), r.get("new_tokens"), r.get("beams")) == (
        64, 32, 64, 4)
    pub = PUBLISHED["beam_search_BASE"] if full else {}
    cells = [r["name"], r["status"], fmt(ms, "{:.1f}"), fmt(r.get("sent_s"), "{:.0f}"),
             fmt(r.get("compile_s"), "{:.1f}"),
             ratio(peer_dec.get("hf marian", {}).get("batch_ms")),
             ratio(peer_dec.get("flax wmt", {}).get("batch_ms")),
             ratio(pub.get("flax wmt")), ratio(pub.get("hf marian"))]
    print("| " + " | ".join(map(str, cells)) + " |" + (f" {r.get('error') or r.get('reason')}"
                                                        if r["status"] != "ok" else ""))
for label, r in peer_dec.items():
    print(f"| peer {label} | ok | {fmt(r['batch_ms'], '{:.1f}')} | {fmt(r['sent_s'], '{:.0f}')} "
          f"| {fmt(r.get('compile_s'), '{:.1f}')} | | | | |")
check = {r["name"]: r for r in t2t if r["name"].startswith("aot_check")}
if check:
    print("\n### the GPU dry run against the card (bench/aot_check.py): deviceless = compiled on "
          "the CPU backend for this GPU's kind, as on a laptop (estimates); device = compiled "
          "(autotuned) and run here")
    summary = check.get("aot_check", {})
    if summary.get("status") != "ok":
        print(f"aot_check: {summary.get('status')} {summary.get('error', '')}")
    print("| part | total GiB | temporaries GiB | step ms | tgt tok/s | MFU@datasheet | verdict |")
    print("|---|---|---|---|---|---|---|")
    for part in ("deviceless", "device"):
        r = check.get(f"aot_check_{part}")
        if r:
            print(f"| {part} | {fmt(r.get('total_gib'))} | {fmt(r.get('temp_gib'))} | "
                  f"{fmt(r.get('step_ms'))} | {fmt(r.get('tgt_tok_s'), '{:,.0f}')} | "
                  f"{fmt(r.get('mfu'), '{:.1%}')} | {r.get('verdict', '')} |")
    ratios = {k: v for k, v in summary.items() if k.endswith("_device_over_deviceless")}
    if ratios:
        print("device / deviceless: " + ", ".join(
            f"{k.removesuffix('_device_over_deviceless')} {v:.3g}" for k, v in ratios.items()))
bad = [r for r in peers if r.get("status") != "ok"]
for r in bad:
    print(f"peer {r['section']}/{r['name']}: {r['status']} {r.get('reason') or r.get('error', '')}")
EOF
echo "# run_gpu.sh done after $(( $(date +%s) - START ))s, results in $OUT"
sleep 1  # let tee write the last lines to run_gpu.log
