#!/usr/bin/env bash
# The test suite on the CPU tier. Creates/reuses .venv (scripts/env.sh), then runs pytest.
# With no arguments runs the default suite (everything not marked slow); arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` or `bash scripts/test.sh tests/fp8 -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
start=$(date +%s)
set +e
python -m pytest "$@"
status=$?
set -e
echo "[test] pytest exited $status after $(( $(date +%s) - start )) s"
# pytest exits 5 when nothing was collected: for a suite that must test something, that is a failure.
if [ "$status" -eq 5 ]; then
  echo "[test] no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
