#!/bin/bash
# Data-parallel training on a workstation with mpirun/mpiexec.
#   bash jobs/local/digits.sh            # 2 ranks
#   NP=4 bash jobs/local/digits.sh --set train.steps=1000
set -euo pipefail
cd "$(dirname "$0")/../.."
NP=${NP:-2}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun)}
exec "$MPIEXEC" -n "$NP" hpctrain train jobs/configs/digits.toml "$@"
