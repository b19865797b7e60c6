#!/bin/bash
# Data-parallel training on a workstation with mpirun/mpiexec (MPICH or Open MPI).
#   bash jobs/local/digits.sh            # 2 ranks
#   NP=4 bash jobs/local/digits.sh --set train.steps=1000
#   MPIEXEC=/opt/openmpi/bin/mpirun bash jobs/local/digits.sh
# Open MPI refuses more ranks than cores without --oversubscribe (its MCA variable for that is
# ignored by Open MPI 5) and refuses root without --allow-run-as-root; both are added here only
# when the launcher's --version says it is Open MPI. MPICH (Hydra) needs neither.
set -euo pipefail
cd "$(dirname "$0")/../.."
NP=${NP:-2}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun || true)}
if [[ -z $MPIEXEC ]]; then
  echo "hpctrain: error: no mpiexec or mpirun on PATH: install an MPI (pip install 'hpctrain[mpich]') or set MPIEXEC" >&2
  exit 2
fi
flags=()
if "$MPIEXEC" --version 2>&1 | grep -qE 'Open MPI|OpenRTE|prte|PRRTE'; then
  if [ "$(id -u)" -eq 0 ]; then flags+=(--allow-run-as-root); fi
  # Open MPI's slots are physical cores, not hardware threads
  cores=$( (lscpu -p=CORE,SOCKET 2>/dev/null || true) | grep -v '^#' | sort -u | wc -l)
  if [ "$cores" -eq 0 ]; then cores=$(nproc); fi
  if [ "$NP" -gt "$cores" ]; then flags+=(--oversubscribe); fi
fi
exec "$MPIEXEC" ${flags[@]+"${flags[@]}"} -n "$NP" hpctrain train jobs/configs/digits.toml "$@"
