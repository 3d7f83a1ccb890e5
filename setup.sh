#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs maxtrain with its pinned dependencies.
# Idempotent: reinstalls only when pyproject.toml changed since the last successful install.
#
#   ./setup.sh                 maxtrain, its dependencies and the test tools
#   ./setup.sh tpu-compiler    also the TPU compiler (libtpu, the `tpu-compiler` extra), into
#                              .venv/tpu-compiler rather than site-packages: maxtrain loads it
#                              only to compile for a TPU topology (maxtrain/parallel/topology.py), and
#                              other jax processes on this host never see it
#   ./setup.sh gpu-compiler    also jax's CUDA plugin (the `gpu-compiler` extra), into
#                              .venv/gpu-compiler, the same way: loaded only to compile for a GPU
#                              target (--topology h100), so no process looks for a GPU otherwise
set -euo pipefail
cd "$(dirname "$0")"

compilers=()
for arg in "$@"; do
  case "$arg" in
    tpu-compiler|gpu-compiler) compilers+=("$arg") ;;
    *) echo "setup.sh: unknown argument '$arg'; expected: tpu-compiler, gpu-compiler" >&2; exit 2 ;;
  esac
done

find_python() {
  # jax 0.11.2 needs Python >= 3.12; a plain `python3` is often older, so look further.
  local cand
  for cand in "${MAXTRAIN_PYTHON:-}" python3.12 python3 python3.13; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv shims refuse to run unless a version is selected: ask pyenv for its installs directly.
  # 3.12 first: it is what the GPU images run, so CPU and GPU resolve the same wheels.
  if command -v pyenv >/dev/null 2>&1; then
    for cand in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.'; \
                  pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[3-9])\.'); do
      local py; py="$(pyenv root)/versions/$cand/bin/python3"
      if [ -x "$py" ]; then echo "$py"; return 0; fi
    done
  fi
  return 1
}

install_apart() {
  # An extra (tpu-compiler, gpu-compiler) into .venv/<extra>, outside site-packages; its pinned
  # requirements read from pyproject.toml (the one place they are written).
  local extra="$1" req dir=".venv/$1"
  req="$(.venv/bin/python -c 'import sys, tomllib; print(" ".join(tomllib.load(open(
    "pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' "$extra")"
  if [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$req" ]; then
    return 0
  fi
  rm -rf "$dir"
  if ! .venv/bin/python -m pip install -q --no-deps --target "$dir" $req >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup.sh: installing $extra ($req) failed (log above, also in $log)" >&2
    exit 1
  fi
  echo "$req" > "$dir/.installed"
  echo "setup.sh: $extra ready ($req in $dir)"
}

install_compilers() {
  local extra
  for extra in ${compilers[@]+"${compilers[@]}"}; do install_apart "$extra"; done
}

stamp=.venv/.maxtrain-installed
log=.venv/install.log
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  install_compilers
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  if ! py="$(find_python)"; then
    echo "setup.sh: maxtrain needs Python >= 3.12 (jax 0.11.2 requires it) and none was found." >&2
    echo "setup.sh: install one (e.g. 'pyenv install 3.12' or your OS package python3.12)," \
         "or point MAXTRAIN_PYTHON at it." >&2
    exit 2
  fi
  echo "setup.sh: creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
# pip is noisy (build-backend warnings, mirror notices): keep its output unless it fails.
if ! { .venv/bin/python -m pip install -q --upgrade pip &&
       .venv/bin/python -m pip install -q -e ".[test]"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup.sh: installing the pinned dependencies failed (log above, also in $log)" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "setup.sh: .venv ready"
install_compilers
