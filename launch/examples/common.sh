# Sourced by the example scripts: checks OUT_DIR, sets $out, $tiny (embedded demo assets), $port (free).
out=${1:?usage: bash $0 OUT_DIR [extra train_ppo flags...]}
tiny=$(python -c 'from rlhf.assets import TINY_DIR; print(TINY_DIR)')
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
