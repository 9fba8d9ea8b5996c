# Sourced by the device calls (benchmarks/device_s*.sh) once they have set `budget` (seconds): the environment of a
# call, its start time, and the step helpers. Skip notices go to the call's own output (fd 3), past any filter a
# step's output goes through.
#   left N          the seconds a step may take: at most N and what is left of the budget; 0 when under 30
#   step N cmd...   run cmd under `timeout` when there is time for it, else say it was skipped
#   machine         say the GPU (and set $gpu), CPU and commit
#   h200_aims       `machine`; on the H200 with PART auto, run the issue-10 aims alone and stop
#   write_mix4      a random 4-layer Mixtral (2.4 GB) written by transformers into /tmp/mix4, for `ferry plan --check`
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
exec 3>&1
t0=$(date +%s)
left() { local t=$(( budget - ($(date +%s) - t0) )); t=$(( t < $1 ? t : $1 )); echo $(( t < 30 ? 0 : t )); }
step() {
    local t; t=$(left "$1"); shift
    if [ "$t" -eq 0 ]; then echo "skipped (no time left): $*" >&3; return; fi
    timeout "$t" "$@"
}
machine() {
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    echo "gpu: $gpu; $(lscpu | grep -m1 'Model name'); commit $commit"
}
h200_aims() {
    machine
    if [[ $gpu == *H200* && $part == auto ]]; then
        bash "$(dirname "${BASH_SOURCE[0]}")/device_s26.sh" "$commit" "$(left 550)" aims
        echo "aims done at $(( $(date +%s) - t0 )) s; call again with PART=rest for the rest"
        exit 0
    fi
}
write_mix4() {
    step 40 python -c "
import torch, transformers
torch.manual_seed(0)
cfg = transformers.MixtralConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                 num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                 num_experts_per_tok=2, max_position_embeddings=4096)
transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained('/tmp/mix4')
print('wrote /tmp/mix4')
" 2>&1 | tail -1
}
