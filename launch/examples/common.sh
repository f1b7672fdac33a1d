# Sourced by the example scripts: checks OUT_DIR, sets $out, $tiny (embedded demo assets), $port (free), and the
# flag blocks the examples share:
#   launch  the launcher on one node at a free port (add --nproc_per_node N -m rlhf.cli.JOB; the pipelines' tests
#           set RLHF_TEST_LAUNCH_SOCKET to start the ranks from a preloaded server instead, tests/launch_server.py);
#   cpu     float32 weights and PyTorch's attention (the CPU's);
#   logged  every step logged, no checkpoints, held-out evaluation before the first step and after the last;
#   pairs   the embedded preference pairs and their held-out split (add the prompt's key: --prompt_key prompt, or
#           --input_key prompt for KTO's unpaired rows).
out=${1:?usage: bash $0 OUT_DIR [extra train_ppo flags...]}
tiny=$(python -c 'from rlhf.assets import TINY_DIR; print(TINY_DIR)')
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2034  # used by the scripts that source this file
launch=(python -m rlhf.cli.launch --master_addr 127.0.0.1 --master_port "$port")
if [[ -n ${RLHF_TEST_LAUNCH_SOCKET:-} ]]; then  # set by the examples' tests only: tests/launch_server.py
  # shellcheck disable=SC2034
  launch=(python -m tests.launch_server --client --master_addr 127.0.0.1 --master_port "$port")
fi
# shellcheck disable=SC2034
cpu=(--param_dtype fp32 --attn_implementation sdpa)
# shellcheck disable=SC2034
logged=(--save_steps -1 --logging_steps 1 --eval_steps -1)
# shellcheck disable=SC2034
pairs=(--dataset "$tiny/pairs.jsonl" --eval_dataset "$tiny/pairs_eval.jsonl" --chosen_key chosen --rejected_key rejected
       --input_template "{} ")
