# Every pending GPU measurement in one device call, most needed first, each with its own limit and
# a timestamp, all output tee'd to $OUT/all.txt (a call cut at its limit still brings back what ran).
# Carry gpu/binsR.txz (the four binaries, tools/gpu-check.sh's header, 90-real), gpu/tok.txz and run
# bash tools/gpu-all.sh STEP... (batch spec streams long draw serve tests trunk8 profile)
set -u
[ -x gpu/qflash ] || tar xJf gpu/binsR.txz -C gpu
exec > >(tee -a "$OUT/all.txt") 2>&1
ts() { echo "@@ $(date +%s) $*"; }
B="bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|replayed|load:|peak|decoded ids|draft|spread|implied'
for s in "$@"; do
ts $s
case $s in
batch) bash tools/gpu-check.sh batch 2>&1 | grep -v '^NVIDIA' ;;
spec) python3 tools/make_mtp_dir.py /tmp/mtp14m >/dev/null
  timeout 60 gpu/qflash bench -m /tmp/mtp14m --device cuda --prompt-len 64 --gen-len 128 --concurrency 1 --runs 2 --draft 3 2>&1 | grep -E "draft|rror|implied|ids"
  timeout 150 gpu/qflash $B --prompt-len 128 --gen-len 64 --concurrency 1 --runs 1 --draft 3 2>&1 | grep -E "$show" ;;
streams) timeout 150 gpu/qflash $B --cuda-opt steptime=1 --prompt-len 128 --gen-len 32 --concurrency 1,16,64 --runs 1 --json $OUT/c1-16-64.json 2>&1 | grep -E "$show" ;;
long) timeout 70 gpu/qflash $B --prompt-len 8192 --gen-len 4 --prefill-chunk 2048 --concurrency 1 --runs 1 --json $OUT/8k.json 2>&1 | grep -E "$show"
  timeout 70 gpu/qflash $B --prompt-len 32768 --gen-len 2 --prefill-chunk 2048 --concurrency 1 --runs 1 --json $OUT/32k.json 2>&1 | grep -E "$show" ;;
draw) QFLASH_TEST_QUICK=10 timeout 60 gpu/test_cuda . 2>&1 | grep -E "FAIL|checks|rror|dec draw" | head -20
  QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "FAIL|checks|draws|verify|rror" | head -20 ;;
serve) bash tools/gpu-check.sh serve-sharegpt 2>&1 | grep -v '^NVIDIA' ;;
*) bash tools/gpu-check.sh $s 2>&1 | grep -v '^NVIDIA' ;;
esac
done
ts end
